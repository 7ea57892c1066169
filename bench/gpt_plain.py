"""The realistic script as people write it for torchrun: the baseline that
examples/train_gpt.py was converted from (docs/training-loop.md shows the diff).

Plain DDP: ``init_process_group``, ``DistributedSampler``, a ``DataLoader`` with worker
processes, its own ``torch.save`` of model, optimizer, scheduler, scaler and EMA every
``--checkpoint-interval`` steps, loaded on start. The model, data, optimizer, schedule,
accumulation, autocast, clipping and EMA are examples/train_gpt.py's own, so the two
differ in the training loop only. Logs the same ``step= ... world= ... pid= t=`` lines,
which the bench reads::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=gpt bench/gpt_plain.py --steps 200
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler

# the installed name of examples/ (this file runs as a script, the checkout is not on the path)
from elasticjob_examples.train_gpt import (  # type: ignore[import-not-found]  # isort: skip
    GPT,
    Sequences,
    parse_args,
    use_bf16,
    warmup_cosine,
)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun's convention: a GPU each
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    bf16 = use_bf16(args.autocast, device)
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, warmup_cosine(args.warmup, args.steps))
    scaler = torch.amp.GradScaler(device.type)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # type: ignore[no-untyped-call]
    dataset = Sequences(args.samples, args.seq, args.vocab)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    ckpt = Path(args.checkpoint_dir or "/tmp/gpt-plain") / "latest.pt"
    step, epoch = 0, 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        for name, obj in (("model", model), ("optim", optim), ("sched", sched),
                          ("scaler", scaler), ("ema", ema)):  # fmt: skip
            obj.load_state_dict(state[name])
        step, epoch = state["step"], state["epoch"]
    ddp = DDP(model)
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
                sync = i == len(micro_batches) - 1
                inputs, targets = inputs.to(device), targets.to(device)
                with ddp.no_sync() if not sync else torch.enable_grad():
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        logits = ddp(inputs)
                        loss = loss_fn(logits.float().flatten(0, 1), targets.flatten())
                    scaler.scale(loss / len(micro_batches)).backward()
            scaler.unscale_(optim)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optim)
            scaler.update()
            optim.zero_grad(set_to_none=True)
            sched.step()
            ema.update_parameters(model)
            step += 1
            samples += args.batch_size * args.accumulate * world
            if rank == 0 and step % args.checkpoint_interval == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                state = {"model": model.state_dict(), "optim": optim.state_dict(),
                         "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                         "ema": ema.state_dict(), "step": step, "epoch": epoch}  # fmt: skip
                torch.save(state, ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
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
