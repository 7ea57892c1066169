"""The hang decision: from a round's step history and the time to hung or not."""

from __future__ import annotations

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.records import Hang, decode_hang, encode_hang
from elasticjob_runtime.launch.hang import (
    StepClock,
    group_step,
    hung_after,
    parse_timeout,
    timeout_from_env,
)

T = 30.0


def test_the_clock_does_not_run_before_the_first_step_of_the_round() -> None:
    # Rendezvous, restore and the first step's warm-up report nothing: never a hang.
    assert not hung_after([], None, now=10_000, timeout=T)
    assert not hung_after([(5.0, None), (500.0, None)], None, now=10_000, timeout=T)


def test_after_the_first_step_the_timeout_is_the_longest_gap_between_steps() -> None:
    history = [(100.0, 1), (101.0, 2), (102.0, 3)]
    assert not hung_after(history, None, now=102 + T - 0.1, timeout=T)
    assert hung_after(history, None, now=102 + T, timeout=T)


def test_a_slow_first_step_is_not_a_hang() -> None:
    # 10 minutes of compilation, then steps: the clock starts at the first one.
    assert not hung_after([(600.0, 1), (601.0, 2)], None, now=620, timeout=T)


def test_repeating_the_same_step_is_not_progress() -> None:
    # A worker waiting for its next round marks the same step again and again.
    history = [(0.0, 7), *[(float(t), 7) for t in range(1, 40)]]
    assert hung_after(history, None, now=40, timeout=T)


def test_steps_from_before_the_round_do_not_start_its_clock() -> None:
    # Workers that regrouped in place still report step 25 from the last round.
    assert not hung_after([(0.0, 25), (100.0, 25)], 25, now=200, timeout=T)
    assert hung_after([(0.0, 25), (100.0, 26)], 25, now=100 + T, timeout=T)


def test_going_back_to_an_older_step_is_progress() -> None:
    # A restart that restored an older checkpoint.
    assert not hung_after([(0.0, 50), (25.0, 40)], None, now=50, timeout=T)


def test_the_group_step_is_the_lowest_local_worker_step() -> None:
    assert group_step({}) is None
    assert group_step({0: 12, 1: 11}) == 11
    # one local worker stopped at 11 while the other reports 12 again: no progress
    clock = StepClock.start(None).observe(11, 0.0).observe(group_step({0: 12, 1: 11}), 5.0)
    assert clock.hung(T, T)
    assert clock.stalled(T + 1) == pytest.approx(T + 1)


@pytest.mark.parametrize("text", ["abc", "-5", "nan", "inf", "1e400"])
def test_a_bad_timeout_names_its_source_and_the_fix(text: str) -> None:
    with pytest.raises(ValueError, match=r"^ELASTICJOB_HANG_TIMEOUT=.*positive number"):
        timeout_from_env({contract.HANG_TIMEOUT: text})


def test_timeout_off_unless_set() -> None:
    assert timeout_from_env({}) is None
    assert parse_timeout("0", "x") is None
    assert parse_timeout(" 45 ", "x") == 45.0


def test_hang_records_round_trip_and_bad_ones_name_the_field() -> None:
    hang = Hang(
        round=4, pod="job-worker-1", step=120, stalled_seconds=31.5, timeout_seconds=30, updated=1.0
    )
    assert decode_hang(encode_hang(hang)) == hang
    with pytest.raises(ValueError, match="'step'"):
        decode_hang(b'{"round": 1, "pod": "p", "step": "x"}')
    assert contract.hang_key("r", 4).startswith(contract.hang_prefix("r"))
