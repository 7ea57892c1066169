"""Waits that end when something happens: the agent's between monitor passes (a worker
exits, the round watch nudges), a worker's round watcher (a nudge to close)."""

from __future__ import annotations

import fcntl
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elasticjob_runtime.launch.channel import AgentChannel, WorkerChannel
from elasticjob_runtime.launch.monitor_wake import MonitorWake
from elasticjob_runtime.launch.wakeup import Wakeup, pidfd_of

LONG = 30.0  # a wait nothing ends lasts this; every early end below is far shorter
HANG = 10.0  # a generous bound on the early ends, to catch a hang, not to time them


def _sleeper(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_a_nudge_from_another_thread_ends_a_wait_and_none_means_the_timeout() -> None:
    wakeup = Wakeup()
    try:
        assert wakeup.wait([], 0.01) is None
        threading.Timer(0.05, wakeup.nudge).start()
        started = time.monotonic()
        assert wakeup.wait([], LONG) == []
        assert time.monotonic() - started < HANG
        assert wakeup.wait([], 0.01) is None  # the nudge was taken: no second wake
    finally:
        wakeup.close()
    wakeup.nudge()  # after close: nothing to wake, and no error


needs_pidfd = pytest.mark.skipif(
    not hasattr(os, "pidfd_open"), reason="no os.pidfd_open here (Linux 5.3+): only the interval"
)


@needs_pidfd
def test_a_pidfd_is_readable_once_its_process_exits() -> None:
    proc = _sleeper(0.2)
    fd = pidfd_of(proc.pid)
    assert fd is not None, "this Linux refuses pidfd_open: the early wakes are off"
    wakeup = Wakeup()
    try:
        assert wakeup.wait([fd], 0.01) is None
        assert wakeup.wait([fd], LONG) == [fd]
    finally:
        os.close(fd)
        wakeup.close()
        proc.wait()
    assert pidfd_of(proc.pid) is None  # reaped: no such process


def test_descriptors_past_1024_are_waited_on_too() -> None:
    # a training process with gloo's mesh and DataLoader workers holds more than select()
    # can take; its round watcher's wait must not raise there
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip(f"open-file limit {hard} < 2048: cannot hold a descriptor past 1024")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    low = os.open(os.devnull, os.O_RDONLY)
    high = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 1500)
    os.close(low)
    read, write = os.pipe()
    far = fcntl.fcntl(read, fcntl.F_DUPFD_CLOEXEC, 1600)
    os.close(read)
    wakeup = Wakeup()
    try:
        assert wakeup.wait([far], 0.01) is None
        os.write(write, b"!")
        assert wakeup.wait([far], LONG) == [far]
    finally:
        for fd in (high, far, write):
            os.close(fd)
        wakeup.close()


@needs_pidfd
def test_the_monitor_wakes_once_for_each_worker_exit_and_at_a_nudge() -> None:
    wake = MonitorWake()
    running, dying = _sleeper(LONG), _sleeper(0.2)
    try:
        pids = [running.pid, dying.pid]
        started = time.monotonic()
        assert wake.wait(pids, LONG) is True
        assert time.monotonic() - started < HANG
        assert dying.poll() is not None or dying.wait(HANG) is not None
        # the dead worker still listed (the agent has not acted yet): no second wake
        assert wake.wait(pids, 0.2) is False
        threading.Timer(0.05, wake.nudge).start()
        assert wake.wait(pids, LONG) is True
        running.kill()
        assert wake.wait([running.pid], LONG) is True  # a worker exit after the others
        assert wake.wait([], 0.01) is False  # workers replaced: their pidfds let go
    finally:
        for proc in (running, dying):
            proc.kill()
            proc.wait()
        wake.close()


def test_the_monitor_wakes_when_a_worker_rings_the_agents_bell(tmp_path: Path) -> None:
    agent = AgentChannel(tmp_path)
    wake = MonitorWake(agent.bell())
    worker = WorkerChannel(tmp_path, 0)
    try:
        assert wake.wait([], 0.05) is False
        for tell in (
            lambda: worker.request_regroup(3),
            worker.offer_in_place,
            lambda: worker.say_taken(3),
            worker.say_finished,
            lambda: worker.say_fatal("diverged"),
        ):
            threading.Timer(0.05, tell).start()
            started = time.monotonic()
            assert wake.wait([], LONG) is True
            assert time.monotonic() - started < HANG
            assert wake.wait([], 0.05) is False  # the ring was drained: one wake each
    finally:
        wake.close()


def test_a_nudge_never_waits_for_its_lock_so_a_signal_handler_cannot_deadlock() -> None:
    wakeup = Wakeup()
    try:
        wakeup._lock.acquire()  # as if the handler interrupted a nudge() or close()
        wakeup.nudge()  # returns at once
        wakeup._lock.release()
        wakeup.nudge()
        assert wakeup.wait([], LONG) == []
    finally:
        wakeup.close()
