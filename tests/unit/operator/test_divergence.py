"""Rule "Divergence": a stop fails the job once with the worker's line; a resync is a
warning per record; both are counted in status."""

from __future__ import annotations

from datetime import UTC, datetime

from elasticjob_operator import models
from elasticjob_operator.divergence import FAILED, RESYNCED, decide_divergences
from elasticjob_runtime.etcd.records import Divergence, decode_divergence, encode_divergence

NOW = datetime(2026, 1, 1, tzinfo=UTC)
LINE = "the ranks trained different models: at step 13 ... 'optim' differs (ranks [0] vs [1])"


def record(step: int, action: str = "stop") -> Divergence:
    return Divergence(step=step, action=action, message=LINE, pod="train-worker-0", updated=0)


def test_a_stop_fails_the_job_naming_what_differs() -> None:
    outcome = decide_divergences(None, "run", [record(13)], NOW)
    assert outcome is not None and outcome.failure is not None and not outcome.events
    assert (outcome.failure.type, outcome.failure.reason) == ("Warning", FAILED)
    assert outcome.failure.message.startswith(f"train-worker-0: {LINE}")
    assert "fix the script" in outcome.failure.message
    assert outcome.status == models.Divergences(
        count=1, run_id="run", last_step=13, message=outcome.failure.message, time=NOW
    )


def test_resyncs_are_warnings_said_once_each() -> None:
    first = decide_divergences(None, "run", [record(5, "resync")], NOW)
    assert first is not None and first.failure is None
    assert [e.reason for e in first.events] == [RESYNCED]
    assert decide_divergences(first.status, "run", [record(5, "resync")], NOW) is None
    later = decide_divergences(first.status, "run", [record(5, "resync"), record(9, "resync")], NOW)
    assert later is not None and len(later.events) == 1 and later.status.count == 2
    # a new run starts its own count of steps
    other = decide_divergences(later.status, "run-2", [record(5, "resync")], NOW)
    assert other is not None and other.status.count == 3


def test_a_record_round_trips_and_a_bad_one_is_refused() -> None:
    assert decode_divergence(encode_divergence(record(13))) == record(13)
    try:
        decode_divergence(b'{"step": 1, "action": "ignore", "message": "", "pod": ""}')
    except ValueError as exc:
        assert "action 'ignore'" in str(exc)
    else:
        raise AssertionError("an unknown action was accepted")
