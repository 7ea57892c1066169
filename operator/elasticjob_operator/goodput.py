"""The job's ``status.goodput``: the runtime's goodput ledger of the job's current run
(elasticjob_runtime's goodput/ledger.py), with the time before its first agent started
counted as waiting, and the ``Recovered`` event that says what a recovery cost.

Pure. The ledger covers its run from the first agent's start; before that the run was
queued, scheduled or pulling images, which only the operator sees: from the job's
Created condition (or, for a run after a suspension, from its resumption) to the
ledger's opening. docs/goodput.md defines each bucket.
"""

from __future__ import annotations

from datetime import UTC, datetime

from elasticjob_operator import models
from elasticjob_operator.decision import Event, normal
from elasticjob_runtime.goodput.ledger import Cause, Ledger

# What an event says happened, by cause (a cause a newer runtime adds is named as it is).
WHAT: dict[str, str] = {
    Cause.FAILURE: "a worker or a node failed",
    Cause.JOIN: "workers joined",
    Cause.DEPARTURE: "workers left",
    Cause.RESTART: "the worker group restarted",
}


def run_started(status: models.ElasticJobStatus) -> datetime | None:
    """When the job's current run began: its creation for the first, its resumption for
    a later one (rule "Suspend"); None if the status does not say."""
    if status.incarnation == 0:
        created = status.condition(models.ConditionType.CREATED)
        return created.last_transition_time if created is not None else None
    suspended = status.condition(models.ConditionType.SUSPENDED)
    if suspended is not None and suspended.status == "False":
        return suspended.last_transition_time
    return None


def recovery_event(previous: models.Goodput | None, ledger: Ledger) -> Event | None:
    """A ``Recovered`` event when the ledger counts recoveries the status did not
    (``previous``: the status's, of the same run), naming the newest one's cause and
    cost (a read every few seconds may find several)."""
    before = sum(previous.recoveries.values()) if previous is not None else 0
    new = sum(ledger.recoveries.values()) - before
    last = ledger.last
    if new <= 0 or last is None:
        return None
    what = WHAT.get(last.cause, last.cause)
    more = f" ({new} recoveries since the last report)" if new > 1 else ""
    return normal(
        "Recovered",
        f"{what}: training paused {last.pause:.1f} s, going on at step {last.step}{more}",
    )


def goodput_status(ledger: Ledger, started: datetime | None, run_id: str) -> models.Goodput:
    """``status.goodput`` for ``ledger``, of run ``run_id``; ``started``: when the run
    began (:func:`run_started`), None if unknown (then nothing counts as waiting)."""
    opened = datetime.fromtimestamp(ledger.opened, tz=UTC)
    waiting = max(0.0, (opened - started).total_seconds()) if started is not None else 0.0
    wall = waiting + ledger.wall
    ratio = ledger.training / wall if wall > 0 else 0.0
    return models.Goodput(
        run_id=run_id,
        ratio=round(ratio, 4),
        percent=f"{100 * ratio:.1f}%",
        wall_seconds=round(wall, 1),
        training_seconds=round(ledger.training, 1),
        waiting_seconds=round(waiting, 1),
        startup_seconds=round(ledger.startup, 1),
        paused_seconds={cause: round(s, 2) for cause, s in sorted(ledger.paused.items())},
        lost_seconds=round(ledger.lost, 2),
        checkpoint_seconds=round(ledger.checkpoint, 2),
        recoveries=dict(sorted(ledger.recoveries.items())),
        longest_pause_seconds=round(ledger.longest_pause, 2),
        through_time=_time(ledger.through),
        last_recovery=None
        if ledger.last is None
        else models.LastRecovery(
            cause=ledger.last.cause,
            pause_seconds=round(ledger.last.pause, 2),
            step=ledger.last.step,
            time=_time(ledger.last.at),
        ),
    )


def _time(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, tz=UTC).replace(microsecond=0)
