"""The status write is an RFC 7386 merge patch: only what changed is sent, and a field the
new status no longer has is removed (null), so status never keeps stale values."""

from __future__ import annotations

from elasticjob_operator.kube import merge_patch


def test_unchanged_status_sends_nothing() -> None:
    status = {"phase": "Running", "replicaStatuses": {"Worker": {"active": 2}}}
    assert merge_patch(status, dict(status)) == {}


def test_changed_nested_value_is_sent_alone() -> None:
    old = {"phase": "Running", "replicaStatuses": {"Worker": {"active": 2, "failed": 0}}}
    new = {"phase": "Running", "replicaStatuses": {"Worker": {"active": 1, "failed": 0}}}
    assert merge_patch(old, new) == {"replicaStatuses": {"Worker": {"active": 1}}}


def test_removed_fields_become_null_and_lists_are_replaced() -> None:
    old = {"belowMinSince": "2026-01-01T00:00:00Z", "conditions": [{"type": "A"}]}
    new = {"conditions": [{"type": "A"}, {"type": "B"}]}
    assert merge_patch(old, new) == {
        "belowMinSince": None,
        "conditions": [{"type": "A"}, {"type": "B"}],
    }
