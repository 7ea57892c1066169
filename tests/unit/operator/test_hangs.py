"""Rule "Hangs": one HangDetected event per hang record, and the count in status."""

from __future__ import annotations

from datetime import UTC, datetime

from elasticjob_operator import models
from elasticjob_operator.hangs import REASON, decide_hangs, hang_message
from elasticjob_runtime.etcd.records import Hang

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def hang(round_: int, pod: str = "train-worker-1", step: int = 120) -> Hang:
    return Hang(
        round=round_, pod=pod, step=step, stalled_seconds=31.2, timeout_seconds=30, updated=0
    )


def test_a_new_hang_is_one_warning_and_counted() -> None:
    said = decide_hangs(None, "run", [hang(3)], NOW)
    assert said is not None
    status, [event] = said
    assert (event.type, event.reason) == ("Warning", REASON)
    assert event.message == (
        "train-worker-1: no training step for 31 s after step 120 (hangTimeoutSeconds 30, "
        "rendezvous round 3); the agents restarted the worker group from its last "
        "checkpoint, which costs one of maxRestarts"
    )
    assert status == models.Hangs(
        count=1, run_id="run", last_round=3, message=event.message, time=NOW
    )


def test_a_hang_already_said_is_not_said_again() -> None:
    said = decide_hangs(None, "run", [hang(3)], NOW)
    assert said is not None
    assert decide_hangs(said[0], "run", [hang(3)], NOW) is None
    assert decide_hangs(said[0], "run", [], NOW) is None  # nothing read: status stays


def test_each_later_hang_is_its_own_event_in_round_order() -> None:
    first = decide_hangs(None, "run", [hang(3)], NOW)
    assert first is not None
    later = decide_hangs(first[0], "run", [hang(9, step=400), hang(3), hang(5, step=200)], NOW)
    assert later is not None
    status, events = later
    assert [("step 200" in e.message, "step 400" in e.message) for e in events] == [
        (True, False),
        (False, True),
    ]
    assert (status.count, status.last_round) == (3, 9)


def test_expired_records_of_hangs_said_do_not_hide_a_new_one() -> None:
    said = decide_hangs(None, "run", [hang(3), hang(5)], NOW)
    assert said is not None
    again = decide_hangs(said[0], "run", [hang(8)], NOW)  # 3 and 5 are gone from etcd
    assert again is not None and again[0].count == 3


def test_a_new_run_starts_its_rounds_afresh_and_the_count_goes_on() -> None:
    said = decide_hangs(None, "run", [hang(7)], NOW)
    assert said is not None
    resumed = decide_hangs(said[0], "run-1", [hang(2)], NOW)
    assert resumed is not None
    assert (resumed[0].count, resumed[0].run_id, resumed[0].last_round) == (2, "run-1", 2)


def test_the_message_survives_odd_records() -> None:
    assert hang_message(hang(1, pod="")).startswith("a worker: no training step")
    assert len(hang_message(hang(1, pod="p" * 10_000))) < 500
