"""The Run's steady-state cost on a GPU-bound step: examples/train_gpt.py (the Run) against
bench/gpt_plain.py (the same model, data and loop as a torchrun script), one process each
on ``cuda:0``, a GPT of about 135M parameters in bf16 autocast.

What the Run adds to a step: the switch vote's host read, the per-step seeding, the
agreement check (every 100 steps) and, in the third variant, an asynchronous checkpoint
every 50 steps (its device-to-host copy on the training thread). The plain script saves
nothing. Runs alternate plain, Run, Run with saves, ``--reps`` times; the figure is the
median seconds per step between step ``--skip`` and the last, and its ratio to plain's.

``python -m bench.gpu_overhead --out overhead.json`` (bench/gpu.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = [
    "--dim=768",
    "--layers=12",
    "--heads=12",
    "--vocab=32768",
    "--seq=512",
    "--batch-size=32",
    "--accumulate=2",
    "--samples=200000",
    "--workers=6",
    "--threads=4",
    "--warmup=10",
    "--log-every=10",
]
TINY = ["--dim=32", "--layers=1", "--heads=2", "--vocab=64", "--seq=16", "--samples=4096",
        "--workers=1", "--log-every=10"]  # fmt: skip  # --tiny: the driver itself, on CPU
STEP_LINE = re.compile(r"^step=(\d+) .* t=([\d.]+)$", re.M)


def seconds_per_step(text: str, skip: int) -> float:
    """Mean seconds per step from the first logged step at or after ``skip`` to the last."""
    points = [(int(s), float(t)) for s, t in STEP_LINE.findall(text)]
    points = [p for p in points if p[0] >= skip]
    if len(points) < 2:
        raise RuntimeError(f"too few step lines after step {skip}: {text[-2000:]}")
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (t1 - t0) / (s1 - s0)


def variant(
    name: str, steps: int, ckpt: Path, model: list[str]
) -> tuple[list[str], dict[str, str]]:
    args = [*model, f"--steps={steps}", f"--checkpoint-dir={ckpt}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if name == "plain":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(free_port())
        return [sys.executable, str(ROOT / "bench" / "gpt_plain.py"), *args,
                "--checkpoint-interval=1000000"], env  # fmt: skip
    interval = "50" if name == "run-with-saves" else "1000000"
    cmd = [sys.executable, "-m", "elasticjob_examples.train_gpt", *args]
    return [*cmd, f"--checkpoint-interval={interval}"], env


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_overhead", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--skip", type=int, default=30, help="steps of warm-up left out")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="a tiny model: try the driver on CPU")
    args = p.parse_args(argv)
    model = TINY if args.tiny else MODEL
    names = ("plain", "run", "run-with-saves")
    found: dict[str, Any] = {"model": model, "steps": args.steps, "skip": args.skip}
    per_step: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names:
            with tempfile.TemporaryDirectory(prefix="gpu-overhead-") as tmp:
                cmd, env = variant(name, args.steps, Path(tmp) / "ckpt", model)
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                found.setdefault("errors", []).append(
                    f"{name} rep {rep}: exit {out.returncode}: {(out.stdout + out.stderr)[-3000:]}"
                )
                continue
            per_step[name].append(seconds_per_step(out.stdout, args.skip))
            found["seconds_per_step"] = per_step
            args.out.write_text(json.dumps(found, indent=1))
            print(f"{name} rep {rep}: {per_step[name][-1]:.4f} s/step", flush=True)
    medians = {n: statistics.median(v) for n, v in per_step.items() if v}
    found["median_s_per_step"] = medians
    if "plain" in medians:
        found["over_plain"] = {n: m / medians["plain"] for n, m in medians.items()}
    args.out.write_text(json.dumps(found, indent=1))
    print(json.dumps({k: found.get(k) for k in ("median_s_per_step", "over_plain")}))


if __name__ == "__main__":
    main()
