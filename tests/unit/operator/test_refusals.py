"""What a job says when the API server refuses one of its children."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from elasticjob_operator import models, refusals
from elasticjob_operator.conditions import set_condition
from elasticjob_operator.models import ConditionType as C

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FORBIDDEN = json.dumps(
    {
        "kind": "Status",
        "code": 403,
        "message": 'pods "train-worker-0" is forbidden: violates PodSecurity '
        '"restricted:latest": privileged (container "t" must not set '
        "securityContext.privileged=true)",
    }
)


def running_status() -> models.ElasticJobStatus:
    status = models.ElasticJobStatus(restart_count=2)
    set_condition(status, C.CREATED, True, "ElasticJobCreated", "accepted", T0)
    set_condition(status, C.RUNNING, True, "WorkersRunning", "2 of 2", T0)
    status.worker_indexes.launched = [0, 1]
    return status


def test_the_api_servers_own_sentence_is_what_the_user_reads() -> None:
    message = refusals.api_message(FORBIDDEN, "Forbidden")
    event = refusals.refusal_event("Pod", "train-worker-0", message)
    assert event.type == "Warning" and event.reason == "FailedCreate"
    assert event.message.startswith("the API server refused Pod train-worker-0: pods ")
    assert "securityContext.privileged=true" in event.message
    assert refusals.api_message(b"not json", "Forbidden") == "Forbidden"
    assert refusals.api_message(None, "Unprocessable Entity") == "Unprocessable Entity"


def test_a_refusal_is_a_condition_on_the_previous_status_not_a_counted_failure() -> None:
    previous = running_status()
    event = refusals.refusal_event("Pod", "train-worker-2", "forbidden")
    status = refusals.refused_status(previous, event, T0)
    failure = status.condition(C.REPLICA_FAILURE)
    assert failure is not None
    assert (failure.status, failure.reason, failure.message) == (
        "True",
        "FailedCreate",
        event.message,
    )
    # nothing else moves: the refused pod is not launched, no restart is counted
    assert status.worker_indexes.launched == [0, 1]
    assert status.restart_count == 2
    assert status.phase == "Running"  # the condition does not change the phase
    assert previous.condition(C.REPLICA_FAILURE) is None  # a copy


def test_the_condition_clears_once_a_round_creates_what_it_asks() -> None:
    event = refusals.refusal_event("Pod", "train-worker-0", "forbidden")
    refused = refusals.refused_status(running_status(), event, T0)
    cleared = refusals.created_status(refused, T0)
    failure = cleared.condition(C.REPLICA_FAILURE)
    assert failure is not None and failure.status == "False" and failure.reason == "Created"
    untouched = running_status()
    assert refusals.created_status(untouched, T0) is untouched  # never refused: no condition


def test_an_invalid_child_is_one_line_naming_the_spec_field_and_the_api_servers_reason() -> None:
    body = json.dumps(
        {
            "kind": "Status",
            "message": 'Pod "j-worker-0" is invalid: spec.containers[0].name: Invalid value:\n'
            '"Ab": a lowercase RFC 1123 label must consist of ...',
            "reason": "Invalid",
        }
    )
    assert refusals.invalid_message("Pod", "j-worker-0", body, "Unprocessable Entity") == (
        "spec.replicaSpecs.Worker.template: the API server refused the Pod j-worker-0: "
        'Pod "j-worker-0" is invalid: spec.containers[0].name: Invalid value: "Ab": a '
        "lowercase RFC 1123 label must consist of ...; fix spec.replicaSpecs.Worker.template"
    )
    # no Status body: the HTTP reason; an enormous one is cut to fit an event
    assert refusals.invalid_message("Deployment", "j-etcd", "<html>", "Bad Request").startswith(
        "spec.etcd: the API server refused the Deployment j-etcd: Bad Request;"
    )
    long = refusals.invalid_message("Pod", "p", json.dumps({"message": "x" * 10_000}), None)
    assert len(long) < 1200 and "\n" not in long


def test_a_refused_round_writes_its_previous_status_and_the_refusal() -> None:
    event = refusals.refusal_event("Pod", "train-worker-0", "forbidden")
    decision = refusals.refused(running_status(), event, T0)
    assert decision.events == [event] and not decision.create and not decision.delete
    assert decision.status.is_true(C.REPLICA_FAILURE)
    assert decision.status.worker_indexes.launched == [0, 1]  # the refused pods not counted
