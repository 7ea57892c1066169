"""`python -m bench.loader_fork_cost`: what forking a DataLoader's workers costs the
training process's next step, on the realistic example's model.

A worker that joins a running group, or replaces a killed one, forks its loader's
worker processes at its first step (``iter(DataLoader)``), once its model, optimizer,
EMA and the state from its peer are in memory. After a fork every page the two
processes share is copy-on-write: each page the trainer then writes (weights, gradients,
the optimizer's moments, the activations' heap) costs it a page fault and a 4 KiB copy,
once. In the bench's join that first step took the new worker 65,000 page faults and
1.6 s of CPU against its peers' 0.7 s (bench/README.md, "a new worker's first step").

This measures the effect alone: one process trains the example's model at its default
sizes (one thread, its micro-batches a step, AdamW, an EMA), forks ``--children`` idle children
after ``--warm`` steps (what DataLoader's ``fork`` does; the children only sleep), and
reports each step's wall time, CPU time and minor page faults, beside the same process
that forks nothing. ``--busy`` processes train the same model alongside, for the two
cores the bench's other ranks fill.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import side_load
from bench.launchers.scripts import REPO
from bench.report import middle_and_range, write_probe

FIGURES = ("wall_s", "cpu_s", "faults")  # each step's, as train() measures them


def train(steps: int, fork_at: int | None, children: int) -> list[dict[str, float]]:
    """Train ``steps`` steps; fork ``children`` idle children before step ``fork_at``."""
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    gpt = importlib.import_module("elasticjob_examples.train_gpt")  # as check_cost.py does
    a = gpt.parse_args([])  # the example's own sizes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt.GPT(a.vocab, a.seq, a.dim, a.layers, a.heads)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # type: ignore[no-untyped-call]
    loss_fn = nn.CrossEntropyLoss()
    data = gpt.Sequences(a.samples, a.seq, a.vocab)
    size = a.batch_size
    batches = [
        [torch.stack([data[i][j] for i in range(m * size, (m + 1) * size)]) for j in (0, 1)]
        for m in range(16)
    ]
    kids: list[int] = []
    rows = []
    try:
        for step in range(steps):
            if step == fork_at:
                for _ in range(children):
                    pid = os.fork()
                    if pid == 0:  # an idle DataLoader worker: shares the pages, writes none
                        time.sleep(3600)
                        os._exit(0)
                    kids.append(pid)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall, cpu = time.perf_counter(), time.process_time()
            for k in range(a.accumulate):
                inputs, targets = batches[(a.accumulate * step + k) % len(batches)]
                loss = loss_fn(model(inputs).flatten(0, 1), targets.flatten())
                (loss / a.accumulate).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            ema.update_parameters(model)
            rows.append(
                {
                    "wall_s": time.perf_counter() - wall,
                    "cpu_s": time.process_time() - cpu,
                    "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                }
            )
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return rows


def run_case(steps: int, fork_at: int | None, children: int) -> list[dict[str, float]]:
    """One case in a process of its own (a fresh heap, as a new worker has)."""
    code = (
        "import json, sys; from bench.loader_fork_cost import train; "
        f"print(json.dumps(train({steps}, {fork_at}, {children})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    ).stdout
    rows: list[dict[str, float]] = json.loads(out.splitlines()[-1])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.loader_fork_cost")
    p.add_argument("--warm", type=int, default=3, help="steps before the fork")
    p.add_argument("--after", type=int, default=3, help="steps after it")
    p.add_argument("--children", type=int, default=2, help="children forked (loader workers)")
    p.add_argument("--busy", type=int, default=2, help="processes training beside it")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    steps = args.warm + args.after
    busy = f"from bench.loader_fork_cost import train; train({10 * steps * args.reps}, None, 0)"
    cases: dict[str, list[list[dict[str, float]]]] = {"fork": [], "no fork": []}
    with side_load.alongside([busy] * args.busy):
        time.sleep(8)  # the busy processes past their imports
        for _ in range(args.reps):
            cases["fork"].append(run_case(steps, args.warm, args.children))
            cases["no fork"].append(run_case(steps, None, 0))
    print(f"the step after step {args.warm}, median of {args.reps} (min-max):")
    for name, reps in cases.items():
        after = [rep[args.warm] for rep in reps]
        before = [rep[args.warm - 1] for rep in reps]
        for label, rows in (("the step before", before), ("the step after", after)):
            print(f"  {name:8s} {label:16s} " + middle_and_range(rows, FIGURES))
    if args.out is not None:
        write_probe(args.out, args, {"cases": cases})


if __name__ == "__main__":
    main()
