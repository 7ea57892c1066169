"""Spares forked from a warm template: real processes, no etcd, no launcher.

What the pool must keep from a spare started as an interpreter of its own: the agent's
child, its exit status and signals as ``Popen`` reports them, a session of its own, and
nothing left once the pool closes; what forking adds: a refill that is a fork, a
template that fails leaves the pool with fresh interpreters instead of no spares, and
the orphans a subreaper inherits are reaped without touching a child its Popen waits for.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticjob_runtime.launch.spare import Target, WorkerLaunch, send_launch
from elasticjob_runtime.launch.spare_pool import SparePool
from elasticjob_runtime.launch.spare_template import ForkedProcess, become_subreaper, reap_orphans

SCRIPT = """
import sys, time
if sys.argv[1] == "sleep":
    time.sleep(60)
print("rank", __import__("os").environ.get("RANK"), flush=True)
sys.exit(int(sys.argv[1]))
"""


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone for our purpose: it runs nothing
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def launch(pool: SparePool, slot_env: dict[str, str], args: list[str]) -> ForkedProcess:
    spare = pool.take(0, {**os.environ, **slot_env})
    assert spare is not None and isinstance(spare.proc, ForkedProcess)
    send_launch(spare.sock, WorkerLaunch(args, {**os.environ, **slot_env}, False, False), [])
    spare.sock.close()
    return spare.proc


@pytest.fixture
def subreaper() -> Iterator[None]:
    """The pool makes its process a child subreaper, as it does the agent; this test
    process stops being one afterwards, so later tests' orphans go where they did."""
    yield
    ctypes.CDLL(None).prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER off


@pytest.mark.slow
def test_forked_spares_are_our_children_run_workers_and_refill_by_forking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, subreaper: None
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    pool = SparePool(Target("script", str(script)), local_world_size=2)
    pids: list[int] = []
    try:
        pool.fill()
        assert pool.template is not None and not pool.spares  # they wait for the template
        assert pool.wait_warm(120)
        template = pool.template.proc.pid
        assert pool.forks() and len(pool.spares) == 2
        for spare in pool.spares.values():
            assert isinstance(spare.proc, ForkedProcess) and spare.warm
            pid = spare.proc.pid
            pids.append(pid)
            assert os.getsid(pid) == pid  # its own session: killpg stops its tree alone
            # the agent's child, as torch's workers are, not the template's
            assert parent_of(pid) == os.getpid()

        exits = launch(pool, {"RANK": "0"}, [str(script), "3"])
        assert exits.wait(60) == 3
        sleeper = launch(pool, {"RANK": "1"}, [str(script), "sleep"])
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.2)
        assert sleeper.poll() is None
        sleeper.send_signal(signal.SIGKILL)
        assert sleeper.wait(60) == -signal.SIGKILL  # as Popen.returncode says it

        pool.fill()  # the refill: forks, nothing imported again
        assert len(pool.spares) == 2
        assert all(isinstance(s.proc, ForkedProcess) for s in pool.spares.values())
        pids += [s.proc.pid for s in pool.spares.values()]

        # A template that dies leaves its spares (they are ours) and the pool with
        # interpreters of their own from then on.
        os.killpg(template, signal.SIGKILL)
        assert launch(pool, {"RANK": "0"}, [str(script), "0"]).wait(60) == 0
        with caplog.at_level(logging.WARNING):
            pool.fill()
        assert "spares now start as fresh interpreters" in caplog.text
        assert pool.template is None and not pool.forks()
        assert isinstance(pool.spares[0].proc, subprocess.Popen)  # the slot just refilled
        assert isinstance(pool.spares[1].proc, ForkedProcess)  # still warm, still used
        pids += [s.proc.pid for s in pool.spares.values()]
        assert pool.wait_warm(120)
    finally:
        pool.close()
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]


def test_only_orphans_we_inherited_are_reaped_never_a_child_whose_popen_waits(
    subreaper: None,
) -> None:
    assert become_subreaper()
    # A worker-like child in its own session that leaves a process of its session behind
    # (a DataLoader worker) and exits 3: the orphan comes to us, the worker's status
    # stays its Popen's. The orphan (cat) runs until the worker's end of its stdin is
    # closed, after its Popen's __del__ has polled it: a child that exits first (`true`
    # did, on a loaded CI machine) is reaped by that poll and never orphaned.
    leaves_an_orphan = (
        "import subprocess, sys; "
        "subprocess.Popen(['cat'], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL); "
        "sys.exit(3)"
    )
    worker = subprocess.Popen([sys.executable, "-c", leaves_an_orphan], start_new_session=True)
    deadline = time.monotonic() + 30
    reaped: list[int] = []
    while time.monotonic() < deadline:
        reaped += reap_orphans()
        if reaped and Path(f"/proc/{worker.pid}/stat").read_text().split(") ")[1][0] == "Z":
            break
        time.sleep(0.05)
    assert len(reaped) == 1 and reaped[0] != worker.pid
    assert reap_orphans() == []  # the worker's zombie is its Popen's to wait for
    assert worker.wait(10) == 3


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
