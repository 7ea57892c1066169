"""bench.ledger_cost: how the goodput ledger's cost is read into figures."""

from __future__ import annotations

import pytest

from bench import ledger_cost
from bench.ledger_cost import Sample


def sample(step: float = 0.002, committed: float = 4e-6, saved: float = 2e-5) -> Sample:
    return Sample(
        step=step,
        committed=committed,
        committed_loop=3e-6,
        saved=saved,
        encode=1e-5,
        dumps=1e-5,
        publish_every=1.0,
        key_every=5.0,
    )


def test_the_training_threads_share_is_each_commit_and_a_save_per_interval() -> None:
    # 4 us a step and 20 us every 20 steps, against 2 ms: 5 us of 2000
    assert ledger_cost.per_step(sample()) == pytest.approx(0.25)
    assert ledger_cost.per_step(sample(), interval=1) == pytest.approx(1.2)
    with pytest.raises(ValueError):
        ledger_cost.per_step(sample(step=0.0))
    with pytest.raises(ValueError):
        ledger_cost.per_step(sample(), interval=0)


def test_the_publisher_encodes_once_a_record_and_writes_the_key_more_rarely() -> None:
    # (10 + 10) us each second, and 10 us of JSON every 5 s for the ledger key
    assert ledger_cost.publisher_per_second(sample()) == pytest.approx(22e-6)


def test_figures_hold_the_target_and_the_times_behind_them() -> None:
    within, over = ledger_cost.figures([sample()], [])
    assert within.ours == [0.25] and within.met is True and within.target == "< 0.5 %"
    assert "saved every 20" in within.metric and within.unit == "%"
    assert over.ours == [22.0] and over.unit == "us/s" and over.met is None
    assert "step 2 ms; committed 4 us in the step (3 us back to back)" in within.note
    (slow, _) = ledger_cost.figures([sample(committed=1e-5), sample(), sample(committed=2e-5)], [])
    assert slow.ours == [0.55, 0.25, 1.05] and slow.met is False  # the median, 0.55 %
    (failed, _) = ledger_cost.figures([], ["timed out"])
    assert failed.ours == [] and failed.met is None and failed.failures == ["timed out"]


def test_the_publishing_intervals_are_the_runtimes() -> None:
    from elasticjob_runtime.etcd import progress

    every, key = ledger_cost.publish_intervals()
    assert every == progress.reporter_from_env.__kwdefaults__["min_interval"]
    assert key == progress.LEDGER_EVERY_S
