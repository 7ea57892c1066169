"""The thin layer around the decisions: the status write is an RFC 7386 merge patch (only
what changed is sent, a field the new status lost becomes null), and the operator's own
status write does not trigger another round."""

from __future__ import annotations

import json

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


def test_a_refused_child_is_one_line_naming_the_spec_field_and_the_api_servers_reason() -> None:
    from elasticjob_operator.kube import refusal_message

    body = json.dumps(
        {
            "kind": "Status",
            "message": 'Pod "j-worker-0" is invalid: spec.containers[0].name: Invalid value:\n'
            '"Ab": a lowercase RFC 1123 label must consist of ...',
            "reason": "Invalid",
        }
    )
    assert refusal_message("Pod", "j-worker-0", body, "Unprocessable Entity") == (
        "spec.replicaSpecs.Worker.template: the API server refused the Pod j-worker-0: "
        'Pod "j-worker-0" is invalid: spec.containers[0].name: Invalid value: "Ab": a '
        "lowercase RFC 1123 label must consist of ...; fix spec.replicaSpecs.Worker.template"
    )
    # no Status body: the HTTP reason; an enormous one is cut to fit an event
    assert refusal_message("Deployment", "j-etcd", "<html>", "Bad Request").startswith(
        "spec.etcd: the API server refused the Deployment j-etcd: Bad Request;"
    )
    long = refusal_message("Pod", "p", json.dumps({"message": "x" * 10_000}), None)
    assert len(long) < 1200 and "\n" not in long
