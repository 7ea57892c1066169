"""The regression example's model and data, written the way torchft's docs write a trainer.

torchft (the peer the bench races in place) keeps survivors running too, so it gets the
same model, data, optimizer and batch as examples/train_regression.py, in the shape of
torchft's own example (``train_ddp.py``, 0.2.0): a ``Manager`` over a reconfigurable
``ProcessGroupGloo``, weights sent to a joiner over that group (``PGTransport``), its
``DistributedDataParallel`` and ``Optimizer`` wrappers, its ``DistributedSampler`` over
``NUM_REPLICA_GROUPS`` shards, one process per replica group under its own torchrun
(which restarts it), and no disk checkpoint: a restarted group heals from a live one.
Nothing of torchft is patched; bench/launchers/torchft.py runs the job in a network
namespace of its own, since torchft's manager listens on every interface.

Prints the bench's lines: ``step=N epoch= loss= world= samples= pid= t=`` for each
committed step (``world`` is the quorum's participants; every replica group prints, with
no ``rank=``, so the first step of a restarted group counts), ``regrouped at step N
world= t=`` when a surviving group's quorum changes size, and with ``--log-samples 1``
``samples step= ... idx=`` for the indices each group trained in a committed step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

# the example's model and data, so both sides train the same thing
from elasticjob_examples.train_regression import (  # type: ignore[import-not-found]
    make_data,
    make_model,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchft import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
)
from torchft.checkpointing.pg_transport import PGTransport


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's flags the bench passes; ``--checkpoint-interval`` is taken and
    unused (torchft's example keeps no checkpoint: a joiner heals from a peer)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-interval", type=int, default=50)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-samples", type=int, default=0)
    return p.parse_args(argv)


def log(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))

    x, y = make_data(args.samples, args.seed)
    dataset = TensorDataset(x, y)
    # one shard per replica group, of the most groups the job may have (torchft's rule)
    sampler = DistributedSampler(
        dataset,
        replica_rank=replica_group,
        num_replica_groups=replica_groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=args.seed,
    )
    indices: list[int] = []
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=_Recording(sampler, indices),
    )
    model = make_model(args.seed)
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_regression_{replica_group}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device="cpu"),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    loss_fn = nn.MSELoss()

    pid, world, samples, epoch = os.getpid(), None, 0, 0
    while manager.current_step() < args.steps and epoch < args.epochs:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            before = manager.current_step()
            optimizer.zero_grad()  # torchft starts the step's quorum here
            loss = loss_fn(ddp(xb), yb)
            loss.backward()  # the gradients' all-reduce across replica groups
            optimizer.step()  # steps only if every group's all-reduce went through
            step, now = manager.current_step(), time.time()
            if step > before:
                participants = manager.num_participants()
                if world is not None and participants != world:
                    log(f"regrouped at step {step} world={participants} t={now:.3f}")
                world = participants
                samples += participants * len(yb)
                if args.log_samples:
                    ids = ",".join(map(str, indices[-len(yb) :]))
                    log(f"samples step={step} epoch={epoch} group={replica_group} idx={ids}")
                if step % args.log_every == 0:
                    log(
                        f"step={step} epoch={epoch} loss={loss.item():.5f} world={participants} "
                        f"samples={samples} pid={pid} t={now:.3f}"
                    )
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1
    manager.shutdown(wait=False)
    sys.stdout.flush()


class _Recording:
    """The sampler, noting each index it hands out (for ``--log-samples``)."""

    def __init__(self, sampler: DistributedSampler, seen: list[int]) -> None:
        self.sampler, self.seen = sampler, seen

    def __iter__(self) -> Any:
        for i in self.sampler:
            self.seen.append(i)
            yield i

    def __len__(self) -> int:
        return len(self.sampler)


if __name__ == "__main__":
    main()
