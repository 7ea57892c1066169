"""A frozen worker does not hold a regroup: the rules that restart it instead of waiting.

A round handed to running workers in place must be taken within the hang timeout, and
workers that are stopped, or silent for half the timeout, are not handed a round in
place at all (hang.py); the worker tells its agent which round it took (channel.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticjob_runtime.launch.channel import AgentChannel, WorkerChannel
from elasticjob_runtime.launch.hang import (
    InPlaceRound,
    StepClock,
    exiting_ranks,
    hang_message,
    in_place_refusal,
    is_exiting,
    round_in_place,
    stopped_ranks,
    unresponsive,
)

T = 10.0
ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def refusal(
    silent_for: float,
    timeout: float | None = T,
    stopped: tuple[int, ...] = (),
    asked: tuple[int, ...] = (),
    ranks: tuple[int, ...] = (0, 1),
) -> str | None:
    return in_place_refusal(
        silent_for=silent_for, timeout=timeout, stopped=stopped, asked=asked, ranks=ranks
    )


def test_a_stopped_worker_is_never_handed_a_round_in_place() -> None:
    # However recent its last step, and with hang detection off too.
    assert refusal(0.0, stopped=(1,)) == "local rank 1 is stopped and cannot take a round"
    assert refusal(0.0, timeout=None, stopped=(0, 1)) is not None


def test_workers_silent_for_half_the_hang_timeout_are_restarted_not_regrouped() -> None:
    # The agent that declared the hang opened the round at the full timeout; this one
    # sees the same stall a moment earlier or later.
    assert refusal(T / 2 - 0.01) is None
    found = refusal(T * 0.95)
    assert found is not None and "local rank 0, 1 did no step and took no round for 10 s" in found


def test_without_a_hang_timeout_a_long_silence_regroups_in_place() -> None:
    assert refusal(3600.0, timeout=None) is None


def test_workers_that_asked_for_the_round_are_alive_however_long_the_group_stalled() -> None:
    # Their collective failed when the hung peer was restarted: they wait for the round.
    assert refusal(T, asked=(0, 1)) is None
    found = refusal(T, asked=(0,))
    assert found is not None and found.startswith("local rank 1 did no step")


def test_a_round_handed_over_in_place_must_be_taken_within_the_hang_timeout() -> None:
    clock = StepClock.start(41)  # a new round: the clock waits for its first step
    handover = round_in_place(None, 7, now=100.0, taken={}, ranks=[0, 1])
    assert handover == InPlaceRound(7, 100.0)
    assert handover.untaken({0: 7, 1: 6}, [0, 1]) == [1]
    assert handover.untaken({0: 7, 1: 8}, [0, 1]) == []
    # rank 1 never took it: the wait is the stall, and it reaches the timeout
    assert unresponsive(clock, 100 + T - 0.1, handover, [1]) < T
    assert unresponsive(clock, 100 + T, handover, [1]) >= T
    # taken by every worker: only steps count again, and the round's first may be slow
    assert unresponsive(clock, 100 + 10 * T, handover, []) == 0.0


def test_rounds_that_keep_coming_do_not_restart_the_wait_for_a_worker_that_takes_none() -> None:
    first = round_in_place(None, 3, now=50.0, taken={0: 2}, ranks=[0])
    assert round_in_place(first, 4, now=58.0, taken={0: 2}, ranks=[0]) == InPlaceRound(4, 50.0)
    # taken before the next one came: the next wait starts afresh
    assert round_in_place(first, 4, now=58.0, taken={0: 3}, ranks=[0]) == InPlaceRound(4, 58.0)


def test_the_hang_message_names_the_worker_that_never_took_its_round() -> None:
    assert hang_message(12, 31.4, 30, [1]) == (
        "no training step for 31 s (hang timeout 30 s), after step 12, and local rank 1 "
        "never took its new round: restarting the worker group"
    )
    assert ", and" not in hang_message(12, 31.4, 30)


def test_a_worker_says_which_round_it_took_and_a_replaced_one_says_nothing(
    tmp_path: Path,
) -> None:
    agent = AgentChannel(tmp_path)
    worker = WorkerChannel(tmp_path, 1)
    agent.deliver(3, {1: ENV}, abort=False)
    assert agent.taken() == {}  # delivered is not taken: a frozen worker reads nothing
    found = worker.wait_newer(2, timeout=1)
    assert found is not None and agent.taken() == {}  # read is not taken either
    worker.say_taken(found.generation)  # what the Run does with the round it takes
    assert agent.taken() == {1: 3}
    assert worker.wait_newer(3, timeout=0.05) is None
    assert agent.taken() == {1: 3}
    WorkerChannel(tmp_path, 0).request_regroup(3)
    assert agent.regroup_requests() == {0: 3}
    agent.forget_workers()
    assert agent.taken() == {}


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


def test_a_killed_process_counts_as_exiting_until_it_is_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exiting_ranks({0: proc.pid}) == []
        proc.kill()
        deadline = time.monotonic() + 10
        while not exiting_ranks({0: proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exiting_ranks({0: proc.pid}) == [0]  # a zombie: not reaped yet
    finally:
        proc.kill()
        proc.wait()
    assert exiting_ranks({1: proc.pid}) == []  # reaped: its parent has seen the exit
