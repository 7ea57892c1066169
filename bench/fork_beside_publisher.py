"""`python -m bench.fork_beside_publisher`: does a DataLoader forked beside rank 0's
progress publisher lose its workers?

A training process whose progress publisher is inside a gRPC call when the script forks
(a plain ``DataLoader`` forks its workers every epoch) can lose the child: gRPC skips
its fork handlers and the child aborts in gRPC's poller (etcd/fork_gate.py). This runs
loaders of two workers back to back in one process beside a real etcd on loopback and
counts the loaders that failed, in one of two modes:

* ``steady``: one reporter, updated after every batch, publishing as often as it can
  over a connection it keeps open;
* ``fresh``: a new reporter, and its first update, right before every loader: the fork
  meets the reporter opening its connection and granting its lease, as a new rank 0's
  first step after a regroup does.

Run it beside an older runtime with ``PYTHONPATH=<worktree>/trainer-runtime``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from bench.harness import Etcd
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.progress import ProgressReporter

WORKERS = 2
LOADER_TIMEOUT_S = 20  # a loader whose worker hung fails instead of hanging the run


def run(mode: str, endpoint: str, seconds: float) -> dict[str, int | str]:
    data = TensorDataset(torch.arange(64, dtype=torch.float32))
    reporter: ProgressReporter | None = None
    loaders = failed = step = 0
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        if mode == "fresh" or reporter is None:
            if reporter is not None:
                reporter.close(wait=0.5)
            reporter = ProgressReporter(
                parse_endpoints(endpoint),
                f"fork-{os.getpid()}",
                world_size=1,
                min_interval=0.0 if mode == "steady" else 1.0,
            )
        step += 1
        reporter.update(step, samples=8)
        loaders += 1
        try:
            for _ in DataLoader(data, batch_size=16, num_workers=WORKERS, timeout=LOADER_TIMEOUT_S):
                step += 1
                reporter.update(step, samples=8)
        except RuntimeError as exc:
            failed += 1
            print(f"loader {loaders} failed: {exc}", file=sys.stderr, flush=True)
    if reporter is not None:
        reporter.close()
    return {"mode": mode, "loaders": loaders, "failed": failed, "steps": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["steady", "fresh"], default="fresh")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fork-beside-publisher-") as tmp:
        etcd = Etcd.start(Path(tmp))
        try:
            print(json.dumps(run(args.mode, etcd.endpoint, args.seconds)), flush=True)
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
