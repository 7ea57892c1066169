"""A small elastic DDP example: an MLP learns a noisy nonlinear function on CPU.

Launch it with our runtime or plain torchrun (the same script; the benchmark runs both)::

    elasticjob-run --nnodes=1:4 --nproc-per-node=1 --rdzv-endpoint=127.0.0.1:2379 \\
        --rdzv-id=demo -m elasticjob_examples.train_regression --steps 400
    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo examples/train_regression.py
    python examples/train_regression.py          # one process, no launcher

The data is generated from the seed (no downloads), identically on every rank. Each
optimizer step consumes one global batch (``world * batch_size`` samples) through the
runtime's :class:`~elasticjob_runtime.training.sampler.ElasticSampler`, so a resize mid-epoch
neither repeats nor skips a sample; the loss is the exact mean over the global batch
even when the epoch's last batch does not split evenly (a rank may hold no sample).
The training loop is the runtime's :mod:`~elasticjob_runtime.training.run` API: it saves
model, optimizer, sampler and counters every ``--checkpoint-interval`` steps and on
SIGTERM, and under ``elasticjob-run`` a worker whose peer left or joined regroups in
place (``regrouped at step N ...``) and carries on from memory; a new worker gets the
state from a survivor. A restarted group resumes from the newest checkpoint.

Logs one line per ``--log-every`` steps (``step= epoch= loss= world= rank= restarts=
samples= pid= t=``, ``t`` in unix seconds) and, on rank 0 at the end, one line
``ELASTICJOB_RESULT {json}`` with initial and final held-out loss, steps and samples.
Every option has an environment variable (``TRAIN_STEPS``, ``TRAIN_EPOCHS`` ...) so a
manifest can set it without touching the command; flags win.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elasticjob_runtime import ElasticSampler, Run, contract

# the installed name of examples/ (this file runs as a script or a module of it)
from elasticjob_examples.sample_audit import (  # type: ignore[import-not-found]  # isort: skip
    committed_line,
    samples_line,
)

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


# ---------------------------------------------------------------- start-up


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


def startup_summary(timings: Mapping[str, float], first: float | None, how: str) -> str:
    """``startup=<total>s(imports=..,process_group=..,ddp=..,restore=..) start=<how>``.

    ``first`` is when this start began: the process's exec, or for a warm spare the
    moment it was handed the round; None for a regroup in place (no imports), whose
    total includes waiting for the agent's next round."""
    imports = 0.0 if first is None else max(0.0, IMPORTED_AT - first)
    parts = {"imports": imports, **{k: timings.get(k, 0.0) for k in ("process_group", "ddp")}}
    parts["restore"] = timings.get("restore", 0.0)
    total = timings.get("wait", 0.0) + sum(parts.values())
    inner = ",".join(f"{name}={value:.2f}" for name, value in parts.items())
    return f"startup={total:.2f}s({inner}) start={how}"


def start_kind() -> tuple[float | None, str]:
    # A warm spare (elasticjob-run) was exec'd long before its round: count from the
    # moment it was handed the round instead.
    assigned = os.environ.get(contract.WORKER_ASSIGNED_AT)
    if assigned:
        return float(assigned), "warm"
    return process_start_time(), "cold"


# ---------------------------------------------------------------- training


def log(line: str) -> None:
    """One write per line: the ranks share the agent's stdout, and an unbuffered
    ``print`` writes the newline apart, so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def train(config: Config) -> dict[str, Any] | None:
    """Train; returns the result summary on rank 0 (None elsewhere)."""
    first, how = start_kind()
    torch.set_num_threads(config.threads)

    def started(line: str, run: Run, began: float | None, how: str) -> None:
        """What a start, a restart or a regroup in place logs, and how long it took."""
        if config.log_ranks == "all" or run.rank == 0:
            log(
                f"{line} world={run.world_size} rank={run.rank} restarts={run.restarts} "
                f"{startup_summary(run.timings, began, how)} t={time.time():.3f}"
            )

    run = Run(
        checkpoint_dir=config.checkpoint_dir or default_checkpoint_dir(),
        checkpoint_interval=config.checkpoint_interval,
        timeout=config.collective_timeout,
        sigterm_grace=config.sigterm_grace,
        on_regroup=lambda run: started(
            f"regrouped at step {run.global_step} ({run.resumed_from})", run, None, "in-place"
        ),
    )
    x, y = make_data(config.samples + EVAL_SAMPLES, config.seed)
    x_train, y_train = x[: config.samples], y[: config.samples]
    x_eval, y_eval = x[config.samples :], y[config.samples :]
    model = make_model(config.seed)
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    sampler = ElasticSampler(config.samples, seed=config.seed)
    ddp = run.wrap(model, optim, sampler)
    if run.meta.get("initial_loss") is None:
        run.meta["initial_loss"] = evaluate(model, x_eval, y_eval)

    def logs() -> bool:
        return config.log_ranks == "all" or run.rank == 0

    if run.resumed_from.startswith("checkpoint"):
        started(f"resumed from step {run.global_step} ({run.ckpt.directory})", run, first, how)
    elif run.resumed_from.startswith("rank"):
        started(f"resumed from step {run.global_step} ({run.resumed_from})", run, first, how)
    else:
        started("starting fresh", run, first, how)

    window_loss, window_n = 0.0, 0
    t0 = time.monotonic()
    for epoch in run.epochs(config.epochs, max_steps=config.steps):
        for idx in run.batches(torch.tensor, config.batch_size):
            xb, yb = x_train[idx.long()], y_train[idx.long()]
            step = None
            try:
                with run.step() as step:
                    if config.log_samples:  # before the gradient's allreduce (sample_audit.py)
                        log(
                            samples_line(
                                run.global_step + 1,
                                epoch,
                                run.world_size,
                                run.rank,
                                run.round_id,
                                idx.tolist(),
                                time.time(),
                            )
                        )
                    # DDP averages gradients over ranks; scaling the sum by world/global_batch
                    # makes it the gradient of the mean over the whole global batch.
                    sse = ((ddp(xb) - yb) ** 2).sum()
                    optim.zero_grad(set_to_none=True)
                    (sse * (run.world_size / run.global_batch)).backward()
                    optim.step()
            except SystemExit:
                # SIGTERM saved this step at its boundary and exits 143 from inside run.step():
                # the step committed, and its record must say so (sample_audit.py)
                if config.log_samples and step is not None and step.committed:
                    log(committed_line(run.global_step, step.round_id, run.rank, time.time()))
                raise
            if not step.committed:
                continue
            if config.log_samples:
                log(committed_line(run.global_step, step.round_id, run.rank, time.time()))
            if len(idx):
                window_loss += float(sse.item()) / len(idx)
                window_n += 1
            step_no = run.global_step
            if logs() and (step_no % config.log_every == 0 or step_no == config.steps):
                mean = window_loss / window_n if window_n else float("nan")
                log(
                    f"step={step_no} epoch={epoch} loss={mean:.4f} world={run.world_size} "
                    f"rank={run.rank} restarts={run.restarts} samples={run.samples} "
                    f"pid={os.getpid()} t={time.time():.3f}"
                )
                window_loss, window_n = 0.0, 0
            if config.sleep > 0:
                time.sleep(config.sleep)

    run.finish()
    if run.rank != 0:
        return None
    return {
        "initial_loss": run.meta["initial_loss"],
        "final_loss": evaluate(model, x_eval, y_eval),
        "steps": run.global_step,
        "samples_seen": run.samples,
        "epochs": sampler.epoch + (1 if sampler.remaining == 0 else 0),
        "world_size": run.world_size,
        "restarts": run.restarts,
        "regroups": run.regroups,
        "seconds_this_run": round(time.monotonic() - t0, 3),
        "config": asdict(config),
    }


def main(argv: Sequence[str] | None = None) -> None:
    result = train(parse_config(argv))
    if result is not None:
        log(RESULT_PREFIX + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
