"""The thin layer around the decisions: the status write is an RFC 7386 merge patch (only
what changed is sent, a field the new status lost becomes null), and the operator's own
status write does not trigger another round."""

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


def test_the_operators_own_status_write_does_not_trigger_another_round() -> None:
    from elasticjob_operator.handlers import is_own_status_echo

    acted = {"metadata": {"generation": 3}, "status": {"observedGeneration": 3}}
    assert is_own_status_echo("MODIFIED", acted)
    scaled = {"metadata": {"generation": 4}, "status": {"observedGeneration": 3}}
    assert not is_own_status_echo("MODIFIED", scaled)  # kubectl scale bumps generation
    assert not is_own_status_echo(None, acted)  # the initial listing always reconciles
    assert not is_own_status_echo("ADDED", {"metadata": {"generation": 1}})
