"""Waits that end when something happens: the agent's between monitor passes (a worker
exits, the round watch nudges), a worker's round watcher (a nudge to close)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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


def test_a_pidfd_is_readable_once_its_process_exits() -> None:
    proc = _sleeper(0.2)
    fd = pidfd_of(proc.pid)
    assert fd is not None, "this Linux has no pidfd_open (5.3+): the early wakes are off"
    wakeup = Wakeup()
    try:
        assert wakeup.wait([fd], 0.01) is None
        assert wakeup.wait([fd], LONG) == [fd]
    finally:
        wakeup.close()
        proc.wait()
    assert pidfd_of(proc.pid) is None  # reaped: no such process


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
