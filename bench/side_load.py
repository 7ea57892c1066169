"""Processes that take the CPUs beside a measurement, for the cores a job's other ranks
would fill (``bench/loader_fork_cost.py``, ``bench/state_transfer_cost.py``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence

from bench.launchers.scripts import REPO


def training_like(seconds: float) -> str:
    """Code for :func:`alongside`: one thread of matrix products, as a rank's compute
    takes its core, for ``seconds``."""
    return (
        "import torch, time\n"
        "torch.set_num_threads(1)\n"
        "a = torch.randn(512, 512)\n"
        f"end = time.time() + {seconds}\n"
        "while time.time() < end:\n"
        "    a = (a @ a).tanh()\n"
    )


@contextlib.contextmanager
def alongside(codes: Sequence[str]) -> Iterator[None]:
    """Run each of ``codes`` (``python -c``, bounded in time by its own code) in the repo
    while the block runs; SIGKILL them by the processes started here when it ends."""
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO) for code in codes]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
