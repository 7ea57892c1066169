"""A realistic training script, elastic: a small GPT with every piece real scripts have.

A GPT-style decoder (3.3M parameters by default) learns synthetic token sequences, with
what a real script carries beside the model: AdamW, a warmup + cosine ``LambdaLR``,
gradient accumulation over micro-batches, bf16 autocast (where the hardware has bf16), a
``GradScaler``, gradient clipping, dropout, an EMA of the weights, and a ``DataLoader``
with worker processes whose dataset applies a random augmentation. docs/training-loop.md
shows the diff from the plain DDP version of this script; the lines marked ``# elastic``
are the change::

    elasticjob-run --nnodes=1:3 --nproc-per-node=1 --rdzv-endpoint=127.0.0.1:2379 \\
        --rdzv-id=gpt -m elasticjob_examples.train_gpt --steps 200
    python examples/train_gpt.py --steps 50          # one process, no launcher

Every piece of state goes through the Run (``state=`` in ``run.wrap``), so a worker
that is restarted or joins gets the scheduler, the scaler and the EMA with the model,
and the ranks' fingerprints are compared at the first step after every regroup and every
100 steps.

Logs ``step= epoch= loss= lr= world= rank= samples= pid= t=`` every ``--log-every``
steps; ``--log-state 1`` logs every rank's fingerprints of model, optimizer, scheduler,
scaler and EMA after every step, and ``--log-samples 1`` every rank's sample indices, so
a test can compare a faulted run with an unfaulted one step by step. Rank 0 ends with
``ELASTICJOB_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

from elasticjob_runtime import ElasticSampler, Run, StepOutcome  # elastic
from elasticjob_runtime.training.fingerprint import fingerprint

# the installed name of examples/ (this file runs as a script or a module of it)
from elasticjob_examples.sample_audit import (  # type: ignore[import-not-found]  # isort: skip
    committed_line,
    samples_line,
)

RESULT_PREFIX = "ELASTICJOB_RESULT "


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return arguments(__doc__.split("\n", 1)[0]).parse_args(argv)


def arguments(description: str) -> argparse.ArgumentParser:
    """The flags (train_gpt_fsdp.py adds its own to them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--epochs", type=int, default=100, help="passes over the data at most")
    p.add_argument("--samples", type=int, default=4096, help="sequences in the data set")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20, help="warmup steps of the LR schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="the process group's (nccl: one GPU per rank; see docs/recovery.md, On a GPU)",
    )
    p.add_argument(
        "--autocast",
        choices=("auto", "bf16", "off"),
        default="auto",
        help="bf16 autocast (auto: where the device computes bf16 natively; a CPU without "
        "AVX512-BF16 or AMX emulates it about 13x slower than fp32)",
    )
    p.add_argument("--checkpoint-dir", default=os.environ.get("ELASTICJOB_CHECKPOINT_DIR"))
    p.add_argument("--checkpoint-interval", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--log-state", type=int, default=0, help="1: every rank logs fingerprints")
    p.add_argument("--log-samples", type=int, default=0, help="1: every rank logs its indices")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    return p


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Sequence ``i`` follows ``x[t+1] = (a*x[t] + b) mod vocab`` with ``a, b`` from ``i``;
    the augmentation replaces 5 % of the inputs with random tokens (the global RNG,
    seeded per sample by the loader)."""

    def __init__(self, size: int, seq: int, vocab: int) -> None:
        self.size, self.seq, self.vocab = size, seq, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        a, b, x0 = 1 + 2 * (index % 7), index % 13, index % self.vocab
        tokens = [x0]
        for _ in range(self.seq):
            tokens.append((a * tokens[-1] + b) % self.vocab)
        data = torch.tensor(tokens)
        inputs = data[:-1].clone()
        noise = torch.rand(self.seq) < 0.05
        inputs[noise] = torch.randint(0, self.vocab, (int(noise.sum()),))
        return inputs, data[1:], index


class GPT(nn.Module):
    def __init__(
        self, vocab: int, seq: int, dim: int, layers: int, heads: int, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(seq, dim))
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens) + self.positions[: tokens.shape[1]]
        h = self.blocks(h, mask=self.causal, is_causal=True)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def warmup_cosine(warmup: int, total: int) -> Any:
    """The LR factor at a step: linear warmup, then cosine to 10 %. The horizon is the
    run's step count, never derived from the world size (which changes)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Does this CPU compute bf16 natively (AVX512-BF16 or AMX)? Read from the kernel's
    flags; False where there are none to read."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def use_bf16(choice: str, device: torch.device) -> bool:
    """Whether ``--autocast`` runs the forward in bf16 on ``device``."""
    if choice != "auto":
        return choice == "bf16"
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return device.type == "cpu" and cpu_has_bf16()


def timings(run: Run) -> str:
    """The seconds of the Run's last grouping, by part (``timings=wait:0.010,...``)."""
    return "timings=" + ",".join(f"{k}:{v:.3f}" for k, v in run.timings.items())


def say(line: str) -> None:
    """One write per line: the ranks share the agent's stdout, and an unbuffered
    ``print`` writes the newline apart, so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Run(  # elastic
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_interval,
        seed=args.seed,
        backend=args.backend,
        on_regroup=lambda run: say(
            f"regrouped at step {run.global_step} ({run.resumed_from}) "
            f"world={run.world_size} rank={run.rank} {timings(run)} t={time.time():.3f}"
        ),
    )
    dataset = Sequences(args.samples, args.seq, args.vocab)
    loader = run.loader(  # elastic: before the model, so its workers fork from a small process
        dataset, args.batch_size, accumulate=args.accumulate, num_workers=args.workers
    )
    torch.manual_seed(args.seed)
    device = run.device  # elastic: cuda:LOCAL_RANK on a GPU node, else the CPU
    bf16 = use_bf16(args.autocast, device)
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, warmup_cosine(args.warmup, args.steps))
    scaler = torch.amp.GradScaler(device.type)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # type: ignore[no-untyped-call]
    sampler = ElasticSampler(len(dataset), seed=args.seed)  # elastic
    ddp = run.wrap(  # elastic
        model, optim, sampler, state={"scheduler": sched, "scaler": scaler, "ema": ema}
    )
    say(
        f"started ({run.resumed_from}) at step {run.global_step} world={run.world_size} "
        f"rank={run.rank} pid={os.getpid()} device={run.device} {timings(run)} "
        f"t={time.time():.3f}"
    )
    loss_fn = nn.CrossEntropyLoss()
    total = 0.0  # the last step's loss (none ran when the run resumed at its end)
    started = time.monotonic()
    for epoch in run.epochs(args.epochs, max_steps=args.steps):  # elastic
        for micro_batches in loader:  # elastic
            with run.step() as step:  # elastic
                say_samples(args, run, epoch, micro_batches)
                total = 0.0
                for inputs, targets, _ in run.accumulate(micro_batches):  # elastic
                    inputs, targets = inputs.to(device), targets.to(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        logits = ddp(inputs)
                        loss = loss_fn(logits.float().flatten(0, 1), targets.flatten())
                    scaler.scale(loss / len(micro_batches)).backward()
                    total += float(loss.detach()) / len(micro_batches)
                scaler.unscale_(optim)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optim)
                scaler.update()
                optim.zero_grad(set_to_none=True)
                sched.step()
                ema.update_parameters(model)
            if not step.committed:
                continue
            log_step(args, run, step, epoch, total, sched, scaler, ema, model, optim)
            if args.sleep:
                time.sleep(args.sleep)
    run.finish()  # elastic
    if run.rank == 0:
        result = {
            "steps": run.global_step,
            "samples": run.samples,
            "world_size": run.world_size,
            "loss": round(total, 6),
            "model": fingerprint(model),
            "ema": fingerprint(ema),
            "seconds_this_run": round(time.monotonic() - started, 3),
        }
        say(RESULT_PREFIX + json.dumps(result, sort_keys=True))


def log_step(
    args: argparse.Namespace,
    run: Run,
    step: StepOutcome,
    epoch: int,
    loss: float,
    sched: Any,
    scaler: Any,
    ema: nn.Module,
    model: nn.Module,
    optim: torch.optim.Optimizer,
) -> None:
    now = time.time()
    say_committed(args, run, step, now)
    if args.log_state:
        say(
            f"state step={run.global_step} rank={run.rank} world={run.world_size} "
            f"model={fingerprint(model)} optim={fingerprint(optim)} "
            f"scheduler={fingerprint(sched)} scaler={fingerprint(scaler)} "
            f"ema={fingerprint(ema)}"
        )
    say_progress(args, run, epoch, loss, sched, now)


def say_samples(args: argparse.Namespace, run: Run, epoch: int, micro_batches: Any) -> None:
    """With ``--log-samples 1``: this rank's sample indices as the step starts, before
    any collective (sample_audit.py)."""
    if args.log_samples:
        # a filler batch (an epoch's uneven end) trains on nothing: it logs no index
        fillers = run.rank_samples == 0
        indices = [] if fillers else [int(i) for _, _, idx in micro_batches for i in idx]
        step, world, rank = run.global_step + 1, run.world_size, run.rank
        say(samples_line(step, epoch, world, rank, run.round_id, indices, time.time()))


def say_committed(args: argparse.Namespace, run: Run, step: StepOutcome, now: float) -> None:
    """With ``--log-samples 1``: the step this rank just committed, in the step's own round
    (a regroup right after the commit has a new one, and may have rolled the state back;
    sample_audit.py)."""
    if args.log_samples:
        say(committed_line(step.step, step.round_id, run.rank, now))


def say_progress(
    args: argparse.Namespace, run: Run, epoch: int, loss: float, sched: Any, now: float
) -> None:
    """Rank 0's step line every ``--log-every`` steps and at the last (the bench reads it)."""
    step_no = run.global_step
    if run.rank == 0 and (step_no % args.log_every == 0 or step_no == args.steps):
        say(
            f"step={step_no} epoch={epoch} loss={loss:.4f} lr={sched.get_last_lr()[0]:.3e} "
            f"world={run.world_size} rank={run.rank} samples={run.samples} "
            f"pid={os.getpid()} t={now:.3f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
