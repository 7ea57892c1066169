"""A frozen worker does not hold a regroup: the rules that restart it instead of waiting.

A round handed to running workers in place must be taken within the hang timeout, and
workers that are stopped, or silent for half the timeout, are not handed a round in
place at all (hang.py); the worker tells its agent which round it took (channel.py).
"""

from __future__ import annotations

from pathlib import Path

from elasticjob_runtime.launch.channel import AgentChannel, WorkerChannel
from elasticjob_runtime.launch.hang import (
    InPlaceRound,
    StepClock,
    hang_message,
    in_place_refusal,
    round_in_place,
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
