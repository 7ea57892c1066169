"""The job's conditions and the phase they add up to (``status.conditions``, ``.phase``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

from elasticjob_operator import models
from elasticjob_operator.models import ConditionType, ElasticJobStatus

C = ConditionType

# status.phase is the first condition of these that is true
PHASE_ORDER: Final = (
    C.FAILED,
    C.SUCCEEDED,
    C.QUEUED,
    C.SUSPENDED,
    C.RESTARTING,
    C.SCALING,
    C.RUNNING,
    C.CREATED,
)


@dataclass(frozen=True)
class ConditionChange:
    """A condition a decision wants set (see :func:`set_condition`)."""

    type: ConditionType
    value: bool
    reason: str
    message: str


def set_condition(
    status: ElasticJobStatus,
    type_: ConditionType,
    value: bool,
    reason: str,
    message: str,
    now: datetime,
) -> None:
    """Set a condition; lastTransitionTime moves only when True/False flips. A condition
    that was never True is not added just to say False."""
    text: Literal["True", "False"] = "True" if value else "False"
    existing = status.condition(type_)
    if existing is None:
        if not value and type_ not in (C.CREATED, C.RUNNING):
            return
        status.conditions.append(
            models.Condition(
                type=type_,
                status=text,
                reason=reason,
                message=message,
                last_transition_time=now,
            )
        )
        status.conditions.sort(key=lambda c: list(ConditionType).index(c.type))
        return
    if existing.status != text:
        existing.last_transition_time = now
    existing.status = text
    existing.reason = reason
    existing.message = message


def phase_of(status: ElasticJobStatus) -> str:
    for type_ in PHASE_ORDER:
        if status.is_true(type_):
            return type_.value
    return C.CREATED.value
