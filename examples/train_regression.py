"""A small elastic DDP example: an MLP learns a noisy nonlinear function on CPU.

Launch it with our runtime or plain torchrun (the same script; the benchmark runs both)::

    elasticjob-run --nnodes=1:4 --nproc-per-node=1 --rdzv-endpoint=127.0.0.1:2379 \\
        --rdzv-id=demo -m elasticjob_examples.train_regression --steps 400
    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo examples/train_regression.py
    python examples/train_regression.py          # one process, no launcher

The data is generated from the seed (no downloads), identically on every rank. Each
optimizer step consumes one global batch (``world * batch_size`` samples) through the
runtime's :class:`~elasticjob_runtime.sampler.ElasticSampler`, so a resize mid-epoch
neither repeats nor skips a sample; the loss is the exact mean over the global batch
even when the epoch's last batch does not split evenly (a rank may hold no sample).
Model, optimizer, sampler and counters are checkpointed every ``--checkpoint-interval``
steps and on SIGTERM; every rank restores the newest one, so a restarted or resized
group resumes where the last checkpoint left it.

Logs one line per ``--log-every`` steps (``step= epoch= loss= world= rank= restarts=
samples= pid= t=``, ``t`` in unix seconds) and, on rank 0 at the end, one line
``ELASTICJOB_RESULT {json}`` with initial and final held-out loss, steps and samples.
Every option has an environment variable (``TRAIN_STEPS``, ``TRAIN_EPOCHS`` ...) so a
manifest can set it without touching the command; flags win.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoint import CheckpointManager
from elasticjob_runtime.progress import reporter_from_env
from elasticjob_runtime.sampler import ElasticSampler

IMPORTED_AT = time.time()
RESULT_PREFIX = "ELASTICJOB_RESULT "
INPUT_DIM = 16
HIDDEN = 64
EVAL_SAMPLES = 2048


@dataclass(frozen=True)
class Config:
    steps: int
    epochs: int
    batch_size: int
    samples: int
    lr: float
    seed: int
    checkpoint_interval: int
    checkpoint_dir: str | None
    log_every: int
    log_ranks: str
    sleep: float
    threads: int
    collective_timeout: float | None
    log_samples: int
    sigterm_grace: float


# (flag, env name, type, default, help)
OPTIONS: tuple[tuple[str, str, type, Any, str], ...] = (
    ("--steps", "TRAIN_STEPS", int, 2000, "stop after this many optimizer steps"),
    ("--epochs", "TRAIN_EPOCHS", int, 3, "passes over the data (whichever ends first)"),
    ("--batch-size", "TRAIN_BATCH_SIZE", int, 32, "samples per rank per step"),
    ("--samples", "TRAIN_SAMPLES", int, 8192, "training samples generated from the seed"),
    ("--lr", "TRAIN_LR", float, 1e-2, "Adam learning rate"),
    ("--seed", "TRAIN_SEED", int, 0, "seed of the data, the model and the sample order"),
    ("--checkpoint-interval", "TRAIN_CHECKPOINT_INTERVAL", int, 50, "steps between saves"),
    (
        "--checkpoint-dir",
        contract.CHECKPOINT_DIR,
        str,
        None,
        "where checkpoints go (default: a directory per run id under the temp dir)",
    ),
    ("--log-every", "TRAIN_LOG_EVERY", int, 20, "steps between log lines"),
    ("--log-ranks", "TRAIN_LOG_RANKS", str, "0", "ranks that log: 0 or all"),
    ("--sleep", "TRAIN_SLEEP", float, 0.0, "seconds to sleep after each step (for demos)"),
    ("--threads", "TRAIN_THREADS", int, 1, "torch intra-op threads per process"),
    (
        "--collective-timeout",
        "TRAIN_COLLECTIVE_TIMEOUT",
        float,
        None,
        "process-group timeout in seconds (default: torch's)",
    ),
    (
        "--sigterm-grace",
        "TRAIN_SIGTERM_GRACE",
        float,
        5.0,
        "after SIGTERM, seconds to wait for a step boundary before saving the last "
        "completed step anyway (a step here takes milliseconds; a stuck one means a peer left)",
    ),
    (
        "--log-samples",
        "TRAIN_LOG_SAMPLES",
        int,
        0,
        "1: every rank logs the sample indices of every step (`samples step= idx=...`), "
        "so a test can prove no sample repeats within an epoch across resizes",
    ),
)


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Flags win over ``TRAIN_*`` variables, which win over the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    for flag, env, kind, default, text in OPTIONS:
        raw = os.environ.get(env)
        try:
            value = kind(raw) if raw not in (None, "") else default
        except ValueError:
            parser.error(f"{env}={raw!r} is not a valid {kind.__name__} (for {flag})")
        parser.add_argument(flag, type=kind, default=value, help=f"{text} (env {env})")
    ns = parser.parse_args(argv)
    config = Config(**{k: getattr(ns, k) for k in Config.__dataclass_fields__})
    problems = [
        f"{name} must be at least 1 (got {getattr(config, attr)})"
        for name, attr in (
            ("--steps", "steps"),
            ("--epochs", "epochs"),
            ("--batch-size", "batch_size"),
            ("--samples", "samples"),
            ("--checkpoint-interval", "checkpoint_interval"),
            ("--log-every", "log_every"),
            ("--threads", "threads"),
        )
        if getattr(config, attr) < 1
    ]
    if config.sigterm_grace <= 0:
        problems.append(f"--sigterm-grace must be above 0 seconds (got {config.sigterm_grace})")
    if config.log_ranks not in ("0", "all"):
        problems.append(f"--log-ranks must be 0 or all (got {config.log_ranks!r})")
    if problems:
        parser.error(problems[0])
    return config


# ---------------------------------------------------------------- data and model


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a fixed smooth function plus a little noise (same on all ranks)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(INPUT_DIM, 1, generator=gen) / math.sqrt(INPUT_DIM)
    v = torch.randn(INPUT_DIM, 1, generator=gen) / math.sqrt(INPUT_DIM)
    x = torch.randn(n, INPUT_DIM, generator=gen)
    noise = 0.05 * torch.randn(n, 1, generator=gen)
    y = x @ w + 0.5 * torch.sin(3.0 * (x @ v)) + noise
    return x, y


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(INPUT_DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(nn.functional.mse_loss(model(x), y).item())


# ---------------------------------------------------------------- process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(timeout_s: float | None) -> tuple[int, int]:
    """Join the launcher's process group, or make a world of one when run without one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", **kwargs)
    return dist.get_rank(), dist.get_world_size()


def default_checkpoint_dir() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(contract.RDZV_ID) or "local"
    return str(Path(tempfile.gettempdir()) / "elasticjob-examples" / run / "regression")


def process_start_time() -> float | None:
    """When this process started (unix seconds), from /proc; None where there is no /proc.

    Measured back from now with /proc/uptime (10 ms ticks): /proc/stat's boot time is
    whole seconds, too coarse for start-ups of a few seconds.
    """
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class Phases:
    """Wall-clock marks of the start-up, logged so a slow restart can be explained."""

    def __init__(self) -> None:
        # A warm spare (elasticjob-run) was exec'd long before its round: count from the
        # moment it was handed the round instead.
        assigned = os.environ.get(contract.WORKER_ASSIGNED_AT)
        start = float(assigned) if assigned else process_start_time()
        self.marks: list[tuple[str, float]] = [] if start is None else [("exec", start)]
        self.marks.append(("imports", IMPORTED_AT))

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def __str__(self) -> str:
        parts = [
            f"{name}={now - prev:.2f}" for (_, prev), (name, now) in itertools.pairwise(self.marks)
        ]
        total = self.marks[-1][1] - self.marks[0][1]
        how = "warm" if os.environ.get(contract.WORKER_ASSIGNED_AT) else "cold"
        return f"startup={total:.2f}s({','.join(parts)}) start={how}"


# ---------------------------------------------------------------- training


def log(line: str) -> None:
    print(line, flush=True)


def train(config: Config) -> dict[str, Any] | None:
    """Train; returns the result summary on rank 0 (None elsewhere)."""
    phases = Phases()
    torch.set_num_threads(config.threads)
    rank, world = init_distributed(config.collective_timeout)
    phases.mark("process_group")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    logs = config.log_ranks == "all" or rank == 0

    x, y = make_data(config.samples + EVAL_SAMPLES, config.seed)
    x_train, y_train = x[: config.samples], y[: config.samples]
    x_eval, y_eval = x[config.samples :], y[config.samples :]

    model = DistributedDataParallel(make_model(config.seed))
    phases.mark("ddp")
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    sampler = ElasticSampler(config.samples, seed=config.seed)
    meta: dict[str, Any] = {"step": 0, "samples": 0, "initial_loss": None}

    def state() -> Mapping[str, Any]:
        return {"model": model, "optim": optim, "sampler": sampler, "meta": dict(meta)}

    # The node-memory copy is keyed by run id: without a launcher there is none, and a
    # later plain run would silently resume an earlier one, so keep it off there.
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    ckpt = CheckpointManager(
        config.checkpoint_dir or default_checkpoint_dir(), keep=3, memory=launched
    )
    ckpt.install_sigterm_handler(grace_s=config.sigterm_grace)
    ckpt.track(state)
    resumed = ckpt.restore(state())
    phases.mark("restore")
    if resumed is not None:
        meta.update(resumed.state["meta"])
    if meta["initial_loss"] is None:
        meta["initial_loss"] = evaluate(model.module, x_eval, y_eval)
    if logs:
        how = f"resumed from step {meta['step']} ({resumed.path})" if resumed else "starting fresh"
        log(f"{how} world={world} rank={rank} restarts={restarts} {phases} t={time.time():.3f}")

    reporter = reporter_from_env()
    step: int = meta["step"]
    saved_step = step if resumed is not None else None
    window_loss, window_n = 0.0, 0
    started = time.monotonic()
    for epoch in range(sampler.epoch, config.epochs):
        sampler.set_epoch(epoch)
        while sampler.remaining > 0 and step < config.steps:
            global_n = min(world * config.batch_size, sampler.remaining)
            idx = torch.tensor(list(itertools.islice(sampler, config.batch_size)), dtype=torch.long)
            xb, yb = x_train[idx], y_train[idx]
            # DDP averages gradients over ranks; scaling the sum by world/global_n makes the
            # result the gradient of the mean over the whole global batch (uneven ones too).
            sse = ((model(xb) - yb) ** 2).sum()
            loss = sse * (world / global_n)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sampler.advance(world * config.batch_size)
            step += 1
            meta.update(step=step, samples=meta["samples"] + global_n)
            if config.log_samples:
                log(
                    f"samples step={step} epoch={epoch} world={world} rank={rank} "
                    f"idx={','.join(str(i) for i in idx.tolist())} t={time.time():.3f}"
                )
            if len(idx):
                window_loss += float(sse.item()) / len(idx)
                window_n += 1
            ckpt.mark_step(step)
            if step % config.checkpoint_interval == 0:
                ckpt.save(state(), step)
                saved_step = step
            if reporter is not None:
                reporter.update(step, global_n, epoch=epoch, checkpoint_step=saved_step)
            if logs and (step % config.log_every == 0 or step == config.steps):
                mean = window_loss / window_n if window_n else float("nan")
                log(
                    f"step={step} epoch={epoch} loss={mean:.4f} world={world} rank={rank} "
                    f"restarts={restarts} samples={meta['samples']} pid={os.getpid()} "
                    f"t={time.time():.3f}"
                )
                window_loss, window_n = 0.0, 0
            if config.sleep > 0:
                time.sleep(config.sleep)
        if step >= config.steps:
            break

    if ckpt.stop_requested:
        ckpt.mark_step(step)  # SIGTERM during the last step: save and exit 143
    if step % config.checkpoint_interval != 0:
        ckpt.save(state(), step)
    ckpt.close()
    if reporter is not None:
        reporter.publish()
        reporter.close()
    result: dict[str, Any] | None = None
    if rank == 0:
        result = {
            "initial_loss": meta["initial_loss"],
            "final_loss": evaluate(model.module, x_eval, y_eval),
            "steps": step,
            "samples_seen": meta["samples"],
            "epochs": sampler.epoch + (1 if sampler.remaining == 0 else 0),
            "world_size": world,
            "restarts": restarts,
            "seconds_this_run": round(time.monotonic() - started, 3),
            "config": asdict(config),
        }
    dist.destroy_process_group()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    result = train(parse_config(argv))
    if result is not None:
        log(RESULT_PREFIX + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
