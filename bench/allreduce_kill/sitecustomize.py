"""Kill a worker inside its gradient all-reduce, for ``--scenarios allreduce-kill``.

A kill from outside lands where the step spends its time (the regression example's
50 ms sleep), almost never inside the gradient all-reduce, where a survivor is most
likely to break: its peer's bytes stop half way through a collective it is in. So the
bench puts this directory on the workers' ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up, in every worker and every warm spare alike) and, when the
fault is due, writes ``<pid> <delay_ms>`` to the file ``BENCH_ALLREDUCE_KILL`` names. The
worker with that pid, at its next gradient all-reduce, starts the collective, lets it run
``delay_ms``, and SIGKILLs itself: its peers are then inside the same all-reduce.

Where the gradient all-reduce is differs by launcher (``BENCH_ALLREDUCE_KILL_IN``):
``torch`` wraps ``torch.distributed.all_reduce`` with ``async_op=True`` (DDP's
communication hook, ours included, is the only caller that starts one asynchronously);
``torchft`` wraps ``torchft.Manager.allreduce`` (its DDP's hook). Nothing else changes,
and without ``BENCH_ALLREDUCE_KILL`` this module does nothing at all.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

TRIGGER = os.environ.get("BENCH_ALLREDUCE_KILL")


def due_delay(trigger: str, pid: int) -> float | None:
    """Seconds to let the collective run before dying, if this process is the victim."""
    try:
        with open(trigger) as f:
            victim, delay_ms = f.read().split()
    except (OSError, ValueError):
        return None  # not written yet (it is renamed into place whole)
    return float(delay_ms) / 1000 if int(victim) == pid else None


def dying(start: Callable[..., Any], trigger: str) -> Callable[..., Any]:
    """``start`` (a call that begins an all-reduce and returns its work or future), which
    the victim process follows with its own SIGKILL."""

    def call(*args: Any, **kwargs: Any) -> Any:
        delay = due_delay(trigger, os.getpid())
        started = start(*args, **kwargs)
        if delay is not None:
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        return started

    return call


def install(trigger: str, where: str) -> None:
    if where == "torchft":
        from torchft.manager import Manager

        Manager.allreduce = dying(Manager.allreduce, trigger)
        return
    import torch.distributed as dist

    plain = dist.all_reduce
    wrapped = dying(plain, trigger)

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        return (wrapped if kwargs.get("async_op") else plain)(*args, **kwargs)

    dist.all_reduce = all_reduce


if TRIGGER:
    install(TRIGGER, os.environ.get("BENCH_ALLREDUCE_KILL_IN", "torch"))
