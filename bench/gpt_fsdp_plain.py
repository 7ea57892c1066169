"""The sharded script as people write it for torchrun: the baseline that
examples/train_gpt_fsdp.py was converted from (docs/training-loop.md shows the diff).

Plain FSDP2: ``init_process_group``, ``fully_shard`` per block and on the root over a
1-D mesh of the world, AdamW and a warmup + cosine ``LambdaLR``, ``DistributedSampler``,
a ``DataLoader`` with worker processes, accumulation and clipping, and its own DCP
checkpoint (``torch.distributed.checkpoint``, every rank its shards) every
``--checkpoint-interval`` steps, loaded on start: DCP reshards it to whatever world loads
it. The model and data are examples/train_gpt.py's own. Logs the same
``step= ... world= ... pid= t=`` lines, which the bench reads::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=gpt bench/gpt_fsdp_plain.py --steps 200
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

# the installed name of examples/ (this file runs as a script, the checkout is not on the path)
from elasticjob_examples.train_gpt import GPT, Sequences, warmup_cosine  # type: ignore[import-not-found]  # isort: skip
from elasticjob_examples.train_gpt_fsdp import parse_args  # type: ignore[import-not-found]  # isort: skip


def newest(directory: Path) -> Path | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last)."""
    done = [p for p in directory.glob("step-*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(re.sub(r"\D", "", p.name)), default=None)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads, args.dropout)
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, warmup_cosine(args.warmup, args.steps))
    dataset = Sequences(args.samples, args.seq, args.vocab)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    ckpt_dir = Path(args.checkpoint_dir or "/tmp/gpt-fsdp-plain")
    step, epoch = 0, 0
    found = newest(ckpt_dir)
    if found is not None:
        model_sd, optim_sd = get_state_dict(model, optim)
        extra: dict[str, Any] = {"step": 0, "epoch": 0, "sched": sched.state_dict()}
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "extra": extra}
        load(state, checkpoint_id=found)
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        step, epoch = int(extra["step"]), int(extra["epoch"])
        sched.load_state_dict(extra["sched"])
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    loss_fn = nn.CrossEntropyLoss()
    samples = step * args.batch_size * args.accumulate * world
    while epoch < args.epochs and step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < args.steps:
            micro_batches = [b for _, b in zip(range(args.accumulate), batches, strict=False)]
            if len(micro_batches) < args.accumulate:
                break
            for i, (inputs, targets, _) in enumerate(micro_batches):
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
                loss = loss_fn(model(inputs).flatten(0, 1), targets.flatten())
                (loss / len(micro_batches)).backward()
            if args.clip:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optim.step()
            optim.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            samples += args.batch_size * args.accumulate * world
            if step % args.checkpoint_interval == 0:
                model_sd, optim_sd = get_state_dict(model, optim)
                saved = {"step": step, "epoch": epoch, "sched": sched.state_dict()}
                save(
                    {"model": model_sd, "optim": optim_sd, "extra": saved},
                    checkpoint_id=ckpt_dir / f"step-{step}",
                )
            if rank == 0 and step % args.log_every == 0:
                print(
                    f"step={step} epoch={epoch} loss={float(loss):.4f} world={world} "
                    f"rank={rank} samples={samples} pid={os.getpid()} t={time.time():.3f}",
                    flush=True,
                )
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
