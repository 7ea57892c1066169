"""NCCL's abort, for real, on one GPU: what :class:`NcclRoundGroup` does at every regroup.

A worker that regroups in place aborts its round's NCCL group and builds the next one in
the same process. Two things must hold, and neither can be seen on CPU:

* **no leak**: build, a collective, abort and destroy, ``--loops`` times; the GPU memory the
  driver reports, the process's threads and file descriptors must not grow with the loop;
* **an abort frees a blocked collective**: a round of two whose second rank never comes
  (what a dead peer looks like), rank 0 blocked in its first all-reduce (NCCL's
  communicator set-up waits for the peer); ``abort`` from another thread must end the wait,
  and the same process must then build a new group and run a collective on it.

One GPU allows one NCCL rank per process (NCCL refuses two ranks on one device), so these
are the single-process halves of a regroup; across GPUs and nodes see docs/recovery.md.

``python -m bench.gpu_nccl --out nccl.json`` (bench/gpu.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.ports import free_port


def assignment(generation: int, world: int) -> Any:
    from elasticjob_runtime.launch.channel import Assignment

    env = {
        "RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    return Assignment(generation, env)


def process_counts() -> dict[str, int]:
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def gpu_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def loop(loops: int) -> list[dict[str, Any]]:
    """Build, all-reduce, abort, destroy, ``loops`` times; one row of timings and counts each."""
    import torch
    import torch.distributed as dist

    from elasticjob_runtime.training.round_group import NcclRoundGroup

    group = NcclRoundGroup()
    rows = []
    for generation in range(loops):
        started = time.perf_counter()
        group.build(assignment(generation, 1), timedelta(seconds=60))
        built = time.perf_counter()
        x = torch.full((1 << 20,), float(generation), device=group.device)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        assert float(x[0]) == float(generation), float(x[0])
        reduced = time.perf_counter()
        group.abort()
        aborted = time.perf_counter()
        group.destroy()
        destroyed = time.perf_counter()
        torch.cuda.synchronize()
        rows.append(
            {
                "build_s": built - started,
                "first_collective_s": reduced - built,  # NCCL makes its communicator here
                "abort_s": aborted - reduced,
                "destroy_s": destroyed - aborted,
                "gpu_used_bytes": gpu_used(),
                "allocated_bytes": torch.cuda.memory_allocated(),
                "initialized_after_destroy": dist.is_initialized(),
                **process_counts(),
            }
        )
    return rows


def blocked_abort(wait_s: float, limit_s: float) -> dict[str, Any]:
    """Rank 0 of a round of two whose rank 1 never comes, blocked in its first all-reduce;
    ``abort`` after ``wait_s``; then a new round of one, and a collective on it."""
    import torch
    import torch.distributed as dist

    from elasticjob_runtime.training.round_group import NcclRoundGroup

    group = NcclRoundGroup()
    group.build(assignment(100, 2), timedelta(seconds=limit_s * 4))
    outcome: dict[str, Any] = {}

    def collective() -> None:
        try:
            x = torch.ones(1024, device=group.device)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            outcome["collective"] = "returned (no peer: it should not have)"
        except Exception as exc:  # what the abort makes it raise is the finding
            outcome["collective"] = f"raised {type(exc).__name__}: {str(exc)[:300]}"

    thread = threading.Thread(target=collective, daemon=True)
    thread.start()
    time.sleep(wait_s)
    blocked = thread.is_alive()
    started = time.perf_counter()
    group.abort()
    thread.join(limit_s)
    freed = not thread.is_alive()
    result: dict[str, Any] = {
        "blocked_before_abort": blocked,
        "freed_by_abort": freed,
        "abort_to_return_s": time.perf_counter() - started if freed else None,
        **outcome,
    }
    if not freed:
        return result  # the thread still holds NCCL: a rebuild here would prove nothing
    group.destroy()
    started = time.perf_counter()
    group.build(assignment(101, 1), timedelta(seconds=60))
    x = torch.full((1024,), 3.0, device=group.device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    result["rebuilt_and_reduced"] = float(x[0]) == 3.0
    result["rebuild_s"] = time.perf_counter() - started
    group.abort()
    group.destroy()
    return result


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = rows[0], rows[-1]
    return {
        "loops": len(rows),
        "build_median_s": statistics.median(r["build_s"] for r in rows),
        "first_collective_median_s": statistics.median(r["first_collective_s"] for r in rows),
        "abort_median_s": statistics.median(r["abort_s"] for r in rows),
        "destroy_median_s": statistics.median(r["destroy_s"] for r in rows),
        "gpu_used_growth_bytes": last["gpu_used_bytes"] - first["gpu_used_bytes"],
        "threads_growth": last["threads"] - first["threads"],
        "fds_growth": last["fds"] - first["fds"],
    }


def blocked_in_child(out: Path, nonblocking: bool, limit_s: float = 40) -> dict[str, Any]:
    """:func:`blocked_abort` in a child process, so an abort that hangs is a finding, not
    the end of the run; ``nonblocking`` sets ``TORCH_NCCL_USE_COMM_NONBLOCKING=1``."""
    env = dict(os.environ)
    if nonblocking:
        env["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
    cmd = [sys.executable, "-m", "bench.gpu_nccl", "--part=blocked", f"--out={out}"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-1500:]
        return {"hung": f"no answer within {limit_s:.0f} s", "output": str(tail)}
    if done.returncode != 0 or not out.exists():
        return {"exit": done.returncode, "output": (done.stdout + done.stderr)[-3000:]}
    return dict(json.loads(out.read_text()))


def loop_in_child(out: Path, env: dict[str, str], loops: int = 5) -> dict[str, Any]:
    """The loop's summary in a child with ``env`` set: the first run's abort took 1.0 s
    every time, a figure that looks like a thread polled once a second."""
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu_nccl",
        "--part=loop",
        f"--loops={loops}",
        f"--out={out}",
    ]
    try:
        subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {"hung": "no answer within 60 s"}
    return dict(json.loads(out.read_text())["summary"]) if out.exists() else {"failed": True}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_nccl", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--loops", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part", choices=("all", "loop", "blocked"), default="all")
    args = p.parse_args(argv)
    import torch

    torch.cuda.set_device(0)
    if args.part == "blocked":
        args.out.write_text(json.dumps(blocked_abort(wait_s=3.0, limit_s=20.0)))
        return
    rows = loop(args.loops)
    found: dict[str, Any] = {"summary": summary(rows), "loops": rows}
    args.out.write_text(json.dumps(found, indent=1))
    if args.part == "loop":
        return
    part = args.out.with_name("nccl-blocked.part")
    for name, nonblocking in (("blocked", False), ("blocked_nonblocking_init", True)):
        found[name] = blocked_in_child(part, nonblocking, limit_s=30)
        part.unlink(missing_ok=True)
        args.out.write_text(json.dumps(found, indent=1))
        print(name, json.dumps(found[name]), flush=True)
    found["abort_with_100ms_monitor_poll"] = loop_in_child(
        part, {"TORCH_NCCL_COORD_CHECK_MILSEC": "100"}
    )
    part.unlink(missing_ok=True)
    args.out.write_text(json.dumps(found, indent=1))
    print(json.dumps(found["summary"], indent=1))


if __name__ == "__main__":
    main()
