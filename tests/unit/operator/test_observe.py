"""Reading the runtime's records: a malformed one is no progress, said once at debug."""

from __future__ import annotations

import logging

import pytest

from elasticjob_operator import observe


def test_a_malformed_record_is_said_once_at_debug(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(observe, "_said", set())  # what other tests had said
    caplog.set_level(logging.DEBUG, logger="elasticjob_operator.observe")
    raw = b'{"step": 1, "note": "a record without its other fields"}'
    for _ in range(3):  # every resync reads it again
        assert observe.progress_of(raw) is None
        assert observe.memory_fallbacks_of([b"[]"]) == ()
    said = [r for r in caplog.records if r.name == "elasticjob_operator.observe"]
    assert [r.levelno for r in said] == [logging.DEBUG, logging.DEBUG]
    assert "malformed progress record" in said[0].getMessage()
    assert "'samples_per_second' is missing" in said[0].getMessage()
    assert "malformed node-memory report" in said[1].getMessage()


def test_the_disruption_is_read_from_the_pods_disruption_target_condition() -> None:
    from elasticjob_operator.observe import disruption_of

    def with_condition(reason: str, status: str = "True") -> dict[str, object]:
        condition = {"type": "DisruptionTarget", "status": status, "reason": reason}
        return {"status": {"conditions": [condition]}}

    assert disruption_of(with_condition("EvictionByEvictionAPI")) == "EvictionByEvictionAPI"
    assert disruption_of(with_condition("PreemptionByScheduler")) == "PreemptionByScheduler"
    assert disruption_of(with_condition("DeletionByTaintManager")) == ""  # a lost node
    assert disruption_of(with_condition("EvictionByEvictionAPI", "False")) == ""
    assert disruption_of({"status": {"phase": "Failed", "reason": "Evicted"}}) == "Evicted"
    assert disruption_of({}) == ""
