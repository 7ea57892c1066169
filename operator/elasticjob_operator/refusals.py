"""What the job says when the API server refuses to create one of its children, pure.

A refusal (Pod Security admission, a quota, an invalid template, missing RBAC) repeats
every round until someone changes the template or the namespace, so it must be visible
where users look, not only in the operator's log: a Warning event ``FailedCreate``
(counted, not repeated, by :meth:`~elasticjob_operator.kube.Kube.post_event`) and the
condition ``ReplicaFailure`` with the API server's message, as a ReplicaSet reports it.

The round's own status is not written after a refusal: it would record the refused pods
as launched, and the next round would count their absence as failures against
backoffLimit. The job's previous status plus the condition is written instead
(:func:`refused`, decided on what :meth:`~elasticjob_operator.kube.Kube.apply` returns);
the round is decided again next time. The condition turns False in the decided status of
a round that creates children (:func:`created_status`), written only if all of them are.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Final

from elasticjob_operator.conditions import phase_of, set_condition
from elasticjob_operator.decision import Decision, Event, warning
from elasticjob_operator.models import ConditionType, ElasticJobStatus

REASON: Final = "FailedCreate"
# Refusals that stay until the namespace or the template changes: retried, reported.
REFUSED_CODES: Final = frozenset({403})
# The child itself is invalid: only a new spec helps, so the job fails (InvalidSpec).
INVALID_CODES: Final = frozenset({400, 422})
# Where in the spec each kind of child comes from, for an invalid child's message.
_SOURCE: Final = {
    "Pod": "spec.replicaSpecs.Worker.template",
    "Deployment": "spec.etcd",
    "Service": "the job's name",
}
_MAX_MESSAGE: Final = 800


def api_message(body: object, fallback: str) -> str:
    """The API server's own sentence from a Status body (JSON), else ``fallback``."""
    try:
        parsed = json.loads(body) if isinstance(body, str | bytes) else None
    except ValueError:
        parsed = None
    message = parsed.get("message") if isinstance(parsed, dict) else None
    return str(message) if message else fallback


def invalid_message(kind: str, name: str, body: object, reason: str | None) -> str:
    """One line for a child refused as invalid, with the API server's own reason,
    shortened to fit an event, naming the part of the spec to fix."""
    said = " ".join(api_message(body, reason or "refused").split())
    if len(said) > _MAX_MESSAGE:
        said = said[: _MAX_MESSAGE - 3] + "..."
    source = _SOURCE.get(kind, "the spec")
    return f"{source}: the API server refused the {kind} {name}: {said}; fix {source}"


def refusal_event(kind: str, name: str, message: str) -> Event:
    return warning(REASON, f"the API server refused {kind} {name}: {message}")


def refused_status(previous: ElasticJobStatus, event: Event, now: datetime) -> ElasticJobStatus:
    """The job's previous status with ReplicaFailure True saying what was refused."""
    status = previous.model_copy(deep=True)
    set_condition(status, ConditionType.REPLICA_FAILURE, True, REASON, event.message, now)
    status.phase = phase_of(status)
    return status


def refused(previous: ElasticJobStatus, event: Event, now: datetime) -> Decision:
    """What a round whose child was refused writes instead of its own decision: the
    refusal's event and :func:`refused_status`."""
    return Decision(status=refused_status(previous, event, now), events=[event])


def created_status(status: ElasticJobStatus, now: datetime) -> ElasticJobStatus:
    """After a round whose children were all created: ReplicaFailure, if set, turns False."""
    if not status.is_true(ConditionType.REPLICA_FAILURE):
        return status
    cleared = status.model_copy(deep=True)
    message = "the operator created every child it asked for"
    set_condition(cleared, ConditionType.REPLICA_FAILURE, False, "Created", message, now)
    return cleared
