"""Spares forked from a warm template: real processes, no etcd, no launcher.

What the pool must keep from a spare started as an interpreter of its own: the worker's
exit status and signals as ``Popen`` reports them, a session of its own, and that nothing
is left once the pool closes; and what forking adds: a refill that is a fork, and a
template that fails leaves the pool with fresh interpreters instead of no spares.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticjob_runtime.launch.spare import Target, WorkerLaunch, send_launch
from elasticjob_runtime.launch.spare_pool import SparePool
from elasticjob_runtime.launch.spare_template import ForkedProcess, SpareTemplate

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


@pytest.mark.slow
def test_forked_spares_run_workers_report_their_exits_and_refill_by_forking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
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
            stat = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()
            assert int(stat[1]) == template  # the template's child, not the agent's

        exits = launch(pool, {"RANK": "0"}, [str(script), "3"])
        assert exits.wait(60) == 3  # the status the template reaped
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

        # A template that dies leaves the pool with interpreters of their own.
        os.killpg(template, signal.SIGKILL)
        for spare in pool.spares.values():
            assert spare.proc.wait(60) == 1 or gone(spare.proc.pid)  # died with it
        with caplog.at_level(logging.WARNING):
            pool.fill()
        assert "spares now start as fresh interpreters" in caplog.text
        assert pool.template is None and not pool.forks()
        fresh = list(pool.spares.values())
        assert len(fresh) == 2 and all(isinstance(s.proc, subprocess.Popen) for s in fresh)
        pids += [s.proc.pid for s in fresh]
        assert pool.wait_warm(120)
    finally:
        pool.close()
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid)]


def test_an_exit_reported_before_a_pid_was_reused_is_not_the_new_childs() -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    agent, template = socket.socketpair()
    tracked = SpareTemplate(holder, agent, dict(os.environ), warm=True)
    try:
        # pid 4242 exited, then the template forked a new child that got pid 4242 again,
        # which then exited in turn: each report belongs to the child it follows
        template.sendall(b"exited 4242 0\nforked 4242\n")
        assert tracked.returncode(4242, timeout=1.0) is None
        template.sendall(b"exited 4242 -9\n")
        assert tracked.returncode(4242, timeout=1.0) == -9
    finally:
        template.close()
        tracked.close()
        holder.kill()
        holder.wait()
