"""bench/allreduce_kill: the worker a trigger names dies inside its next asynchronous
all-reduce (a DDP hook's), and no other process or collective is touched; the table
says in how many runs the survivor kept its process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.run import (
    ALLREDUCE_KILL_HOOK,
    Result,
    allreduce_kill_env,
    summarize,
    table,
    write_trigger,
)

# A one-rank gloo group that says which all-reduces it finished, a sync one and an
# async one per turn, until the trigger names it (or 60 s pass).
WORKER = """
import os, socket, time
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    dist.all_reduce(torch.ones(4))
    print("sync done", flush=True)
    dist.all_reduce(torch.ones(4), async_op=True).wait()
    print("async done", flush=True)
    time.sleep(0.01)
"""


def test_the_named_worker_dies_in_its_next_async_all_reduce_and_no_sooner(tmp_path: Path) -> None:
    trigger = tmp_path / "trigger"
    env = {**os.environ, **allreduce_kill_env("elasticjob-run", trigger)}
    assert env["PYTHONPATH"].split(":")[0] == str(ALLREDUCE_KILL_HOOK)
    out = tmp_path / "out"
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=sink, env=env)
    try:
        deadline = time.monotonic() + 60
        while "async done" not in out.read_text():  # the hook lets every call through
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        write_trigger(trigger, proc.pid + 1, 0.0)  # another process: nothing happens
        time.sleep(0.3)
        assert proc.poll() is None
        write_trigger(trigger, proc.pid, 0.5)
        assert proc.wait(timeout=30) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = out.read_text().splitlines()
    assert lines[-1] == "sync done", lines[-3:]  # it died in the async one, not the sync one


def test_the_table_counts_the_runs_whose_survivor_kept_its_process() -> None:
    runs = [
        Result("torchft", "allreduce-kill", 0, seconds=2.0, survivors_kept=True),
        Result("torchft", "allreduce-kill", 1, seconds=2.5, survivors_kept=False),
        Result("torchft", "allreduce-kill", 2, error="timed out"),
        Result("elasticjob-run", "allreduce-kill", 0, seconds=0.3, survivors_kept=True),
    ]
    rows = table(summarize(runs), ["elasticjob-run", "torchft"]).splitlines()
    kept = next(r for r in rows if "survivor kept its process" in r)
    assert [c.strip() for c in kept.strip("|").split("|")][1:] == ["1 of 1", "1 of 3"]
