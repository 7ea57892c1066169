"""bench.coverage: how evenly a run trained its data, read the same way for every launcher."""

from __future__ import annotations

import pytest
from elasticjob_examples.sample_audit import committed_line, samples_line

from bench.coverage import coverage, trained


def _ours(step: int, round_id: str, idx: list[list[int]], committed: bool = True) -> list[str]:
    """Every rank's ``samples`` line of one attempt at ``step``, and rank 0's commit."""
    world = len(idx)
    t = float(step) + (0.5 if round_id == "r2" else 0.0)
    lines = [samples_line(step, 0, world, r, round_id, ids, t) for r, ids in enumerate(idx)]
    return [*lines, committed_line(step, round_id, 0, t + 0.1)] if committed else lines


def test_ours_counts_the_last_committed_attempt_of_each_step_and_no_dropped_one() -> None:
    lines = [
        *_ours(1, "r1", [[0, 1], [2, 3]]),
        *_ours(2, "r1", [[4, 5], [6, 7]]),  # rolled back by a restart: step 2 again below
        *_ours(3, "r1", [[8, 9], [10, 11]], committed=False),  # dropped by a broken group
        *_ours(2, "r2", [[4, 5], [6, 7]]),
    ]
    assert sorted(trained([lines])) == list(range(8))


def test_torchfts_committed_lines_count_and_its_step_lines_do_not() -> None:
    group0 = [
        "samples step=1 epoch=0 group=0 idx=0,1",
        "step=1 epoch=0 loss=0.5 world=2 group=0 samples=4 pid=7 t=1.0",
        "samples step=2 epoch=0 group=0 idx=0,1",  # restarted, healed: its epoch over again
    ]
    group1 = ["samples step=1 epoch=0 group=1 idx=2,3"]
    assert sorted(trained([group0, group1])) == [0, 0, 1, 1, 2, 3]


def test_a_torchft_job_that_started_over_keeps_only_what_the_new_start_trained() -> None:
    # no live group to heal from: both groups' steps go back to 1
    group0 = [f"samples step={n} epoch=0 group=0 idx={n}" for n in (1, 2, 3, 1, 2)]
    group1 = [f"samples step={n} epoch=0 group=1 idx={10 + n}" for n in (1, 2, 3, 1)]
    assert sorted(trained([group0, group1])) == [1, 2, 11]


def test_an_exactly_once_run_is_even_at_any_point_of_an_epoch() -> None:
    found = coverage([*range(10), *range(10), 3, 1, 4], samples=10)
    assert (found.passes, found.even, found.repeated, found.missed) == (2.3, 1.0, 0.0, 0.0)
    assert (found.extra_trainings, found.missing_trainings) == (0, 0)


def test_a_stretch_trained_twice_and_a_shard_skipped_are_told_apart() -> None:
    # 4 epochs of 10: samples 0-1 trained once more, 8-9 skipped in one epoch
    indices = [*range(10), *range(10), *range(8), 0, 1]
    found = coverage([*indices, *range(10)], samples=10)
    assert found.passes == 4.0
    assert (found.even, found.repeated, found.missed) == (0.6, 0.2, 0.2)
    assert (found.extra_trainings, found.missing_trainings) == (2, 2)


def test_a_run_that_logged_no_samples_or_foreign_ones_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--log-samples 1"):
        coverage([], samples=10)
    with pytest.raises(ValueError, match=r"outside the data set of 10: \[12\]"):
        coverage([1, 12], samples=10)
