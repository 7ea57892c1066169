"""For unit tests that need a real gloo group: ``target(rank, port, out, *args)`` in one
spawned process per rank, and what each put on ``out``. Every process must exit 0."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from bench.ports import free_port


def on_ranks(
    target: Callable[..., None], world: int, *args: Any, join_timeout: float = 60.0
) -> list[Any]:
    """One message from each rank's ``target``, in the order they came."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, out, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    got = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=join_timeout)
        assert proc.exitcode == 0
    return got
