"""The realistic script written the way torchft's docs write a trainer.

examples/train_gpt.py's model, data, AdamW, warmup + cosine schedule, 2 micro-batches a
step, bf16 autocast, ``GradScaler``, clipping, EMA and a ``DataLoader`` with 2 worker
processes, in the shape of torchft's own example (``train_ddp.py``, 0.2.0): a ``Manager``
over a reconfigurable ``ProcessGroupGloo`` whose ``state_dict`` a joiner heals from over
``PGTransport`` (here with the scheduler, scaler and EMA beside model and optimizer, so a
healed group trains on what its peer has), its ``DistributedDataParallel`` and
``Optimizer`` wrappers, its ``DistributedSampler`` over ``NUM_REPLICA_GROUPS`` shards,
one process per replica group under its own torchrun (which restarts it), and no disk
checkpoint and no data loader state (the example leaves both to the user). Nothing of
torchft is patched; bench/launchers/torchft.py runs the job in a network namespace.

Prints the bench's lines, like bench/torchft_regression.py: ``step=N epoch= loss= world=
group= samples= pid= t=`` for each committed step (``world`` is the quorum's
participants; every replica group prints), ``regrouped at step N world= t=`` when a
surviving group's quorum changes size, and with ``--log-samples 1`` ``samples step=
epoch= group= idx=`` for the indices a group trained in a committed step.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader
from torchft import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
)
from torchft.checkpointing.pg_transport import PGTransport

# the installed name of examples/ (this file runs as a script, the checkout is not on the path)
from elasticjob_examples.train_gpt import (  # type: ignore[import-not-found]  # isort: skip
    GPT,
    Sequences,
    parse_args,
    use_bf16,
    warmup_cosine,
)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    """``--checkpoint-dir`` and ``--checkpoint-interval`` are taken and unused: torchft's
    example keeps no checkpoint (a restarted group heals from a live one)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    device = torch.device("cpu")
    bf16 = use_bf16(args.autocast, device)
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, warmup_cosine(args.warmup, args.steps))
    scaler = torch.amp.GradScaler(device.type)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # type: ignore[no-untyped-call]
    dataset = Sequences(args.samples, args.seq, args.vocab)
    # one shard per replica group, of the most groups the job may have (torchft's rule)
    sampler = DistributedSampler(
        dataset,
        replica_rank=group,
        num_replica_groups=groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=args.seed,
    )
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    pieces: dict[str, Any] = {
        "model": model,
        "optim": inner,
        "sched": sched,
        "scaler": scaler,
        "ema": ema,
    }

    def load_state_dict(state: dict[str, Any]) -> None:
        for name, obj in pieces.items():
            obj.load_state_dict(state[name])

    def state_dict() -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in pieces.items()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_gpt_{group}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device="cpu"),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    loss_fn = nn.CrossEntropyLoss()

    pid, world, samples, epoch = os.getpid(), None, 0, 0
    while manager.current_step() < args.steps and epoch < args.epochs:
        sampler.set_epoch(epoch)
        for micro_batches in _steps(iter(loader), args.accumulate):
            before = manager.current_step()
            optimizer.zero_grad()  # torchft starts the step's quorum here
            for i, (inputs, targets, _) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with ddp.no_sync() if not last else torch.enable_grad():
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        logits = ddp(inputs)
                        loss = loss_fn(logits.float().flatten(0, 1), targets.flatten())
                    # the last micro-batch's backward all-reduces across replica groups
                    scaler.scale(loss / len(micro_batches)).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)  # steps only if every group's all-reduce went through
            scaler.update()
            step, now = manager.current_step(), time.time()
            if step > before:
                sched.step()
                ema.update_parameters(model)
                participants = manager.num_participants()
                if world is not None and participants != world:
                    say(f"regrouped at step {step} world={participants} t={now:.3f}")
                world = participants
                samples += participants * args.batch_size * len(micro_batches)
                if args.log_samples:
                    ids = ",".join(str(int(i)) for *_, idx in micro_batches for i in idx)
                    say(f"samples step={step} epoch={epoch} group={group} idx={ids}")
                if step % args.log_every == 0:
                    say(
                        f"step={step} epoch={epoch} loss={float(loss):.4f} world={participants} "
                        f"group={group} samples={samples} pid={pid} t={now:.3f}"
                    )
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
        epoch += 1
    manager.shutdown(wait=False)


def _steps(batches: Iterator[Any], accumulate: int) -> Iterator[list[Any]]:
    """The loader's micro-batches, ``accumulate`` at a time; an epoch's short tail is
    dropped, as bench/gpt_plain.py drops it."""
    while len(micro := [b for _, b in zip(range(accumulate), batches, strict=False)]) == accumulate:
        yield micro


if __name__ == "__main__":
    main(sys.argv[1:])
