"""What /proc says about a local process: stopped, or dying (launch/process_state.py).

Read from real processes where the state can be made on demand (stopped, a zombie);
from /proc text where it cannot (a SIGKILL still queued is acted on within
microseconds on an idle machine)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from elasticjob_runtime.launch.process_state import (
    dying_ranks,
    is_dying,
    is_exiting,
    kill_pending,
    stopped_ranks,
)


def test_a_stopped_process_is_seen_as_stopped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stopped_ranks({0: proc.pid}) == []
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped_ranks({0: proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped_ranks({0: proc.pid, 1: 2**22 + 1}) == [0]  # a gone pid is not stopped
        proc.send_signal(signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("pids", [{}, {0: 2**22 + 1}])
def test_no_process_no_stopped_rank(pids: dict[int, int]) -> None:
    assert stopped_ranks(pids) == []


def _stat(state: str, flags: int) -> str:
    return f"4242 (python3 -u (x)) {state} 1 4242 4242 0 -1 {flags} 0 0 0 0 5 3 0 0 20 0 9"


def test_a_worker_that_began_to_die_is_told_from_one_that_runs() -> None:
    assert not is_exiting(_stat("S", 0x400100))  # sleeping: running as far as rounds go
    assert not is_exiting(_stat("R", 0x400140))
    assert is_exiting(_stat("R", 0x400144))  # PF_EXITING: past the start of its exit
    assert is_exiting(_stat("D", 0x404))
    assert is_exiting(_stat("Z", 0x400104))
    assert not is_exiting("garbage")  # unreadable: judged by its exit, as before


def test_a_killed_process_counts_as_dying_until_it_is_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert dying_ranks({0: proc.pid}) == []
        proc.kill()
        deadline = time.monotonic() + 10
        while not dying_ranks({0: proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dying_ranks({0: proc.pid}) == [0]  # a zombie: not reaped yet
    finally:
        proc.kill()
        proc.wait()
    assert dying_ranks({1: proc.pid}) == []  # reaped: its parent has seen the exit


def _status(sig_pnd: int, shd_pnd: int) -> str:
    return (
        "Name:\tpython3\nState:\tR (running)\nTgid:\t4242\n"
        f"SigQ:\t0/94000\nSigPnd:\t{sig_pnd:016x}\nShdPnd:\t{shd_pnd:016x}\n"
        "SigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\n"
    )


def test_a_queued_sigkill_is_seen_before_the_process_acts_on_it() -> None:
    sigkill, sigterm = 1 << (signal.SIGKILL - 1), 1 << (signal.SIGTERM - 1)
    assert not kill_pending(_status(0, 0))
    assert not kill_pending(_status(sigterm, sigterm))  # a SIGTERM may be handled: alive
    assert kill_pending(_status(sigkill, 0))  # the kernel queues it on every thread
    assert kill_pending(_status(0, sigkill | sigterm))
    assert not kill_pending("SigPnd:\tnot hex\n")


def test_a_sleeping_process_is_not_dying_and_a_gone_one_is_not_either() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_dying(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not is_dying(proc.pid)
