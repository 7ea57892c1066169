"""The job's ``status.goodput``: the runtime's goodput ledger of the job's current run
(elasticjob_runtime's goodput/ledger.py), with the time before its first agent started
counted as waiting, and the ``Recovered`` event that says what a recovery cost.

Pure. The ledger covers its run from the first agent's start; before that the run was
queued, scheduled or pulling images, which only the operator sees: from the job's
Created condition (or, for a run after a suspension, from its resumption) to the
ledger's opening. docs/goodput.md defines each bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from elasticjob_operator import models
from elasticjob_operator.decision import Event, normal
from elasticjob_runtime.goodput.ledger import Cause, Ledger, Mark, kept

T = TypeVar("T", int, float)

# The timeline mark of a suspension: from the last run's last entry to the next's start.
SUSPENDED: Final = "suspended"

# What an event says happened, by cause (a cause a newer runtime adds is named as it is).
WHAT: dict[str, str] = {
    Cause.CRASH: "a worker crashed",
    Cause.NODE_LOST: "a node was lost or froze",
    Cause.HANG: "the training hung and the group restarted",
    Cause.DIVERGENCE: "the ranks diverged and rank 0's state was copied to every rank",
    Cause.FAILURE: "a worker or a node failed",
    Cause.JOIN: "workers joined",
    Cause.DEPARTURE: "workers left",
    Cause.RESTART: "the worker group restarted",
}


def run_started(
    status: models.ElasticJobStatus, created: datetime | None = None
) -> datetime | None:
    """When the job's current run began: its creation for the first (``created``, the
    job's creationTimestamp, else its Created condition, which comes with the operator's
    first round: later by the operator's latency), its resumption for a later one (rule
    "Suspend"); None if neither says."""
    if status.incarnation == 0:
        if created is not None:
            return created
        condition = status.condition(models.ConditionType.CREATED)
        return condition.last_transition_time if condition is not None else None
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


def goodput_status(
    ledger: Ledger,
    started: datetime | None,
    run_id: str,
    earlier: models.GoodputTotals | None = None,
) -> models.Goodput:
    """``status.goodput`` for ``ledger``, of run ``run_id``. ``started``: when the run
    began (:func:`run_started`), None if unknown (then nothing counts as waiting);
    ``earlier``: the job's runs before this one (:func:`earlier_runs`), whose time
    from their last entry to this run's opening is waiting (a suspension) instead."""
    opened = datetime.fromtimestamp(ledger.opened, tz=UTC)
    if earlier is not None:
        started = earlier.through_time
    waiting = max(0.0, (opened - started).total_seconds()) if started is not None else 0.0
    marks = [_mark(m) for m in ledger.marks]
    before = earlier or _no_runs(opened)
    if earlier is not None:
        suspended = models.TimelineMark(
            cause=SUSPENDED,
            since=earlier.through_time,
            time=opened,
            pause_seconds=round(waiting, 3),
            from_step=earlier.step,
            step=marks[0].step if marks else earlier.step,
            world=0,
        )
        marks.insert(0, suspended)
    wall = before.wall_seconds + waiting + ledger.wall
    training = before.training_seconds + ledger.training
    ratio = training / wall if wall > 0 else 0.0
    return models.Goodput(
        run_id=run_id,
        runs=before.runs + 1,
        ratio=round(ratio, 4),
        percent=f"{100 * ratio:.1f}%",
        wall_seconds=round(wall, 3),
        training_seconds=round(training, 3),
        waiting_seconds=round(before.waiting_seconds + waiting, 3),
        startup_seconds=round(before.startup_seconds + ledger.startup, 3),
        paused_seconds=_sum(before.paused_seconds, ledger.paused, 3),
        lost_seconds=round(before.lost_seconds + ledger.lost, 3),
        checkpoint_seconds=round(before.checkpoint_seconds + ledger.checkpoint, 3),
        recoveries=_sum(before.recoveries, ledger.recoveries),
        longest_pause_seconds=round(max(before.longest_pause_seconds, ledger.longest_pause), 3),
        step=ledger.step if ledger.started else before.step,
        through_time=_time(ledger.through),
        timeline=kept([*before.timeline, *marks]),
        last_recovery=None
        if ledger.last is None
        else models.LastRecovery(
            cause=ledger.last.cause,
            pause_seconds=round(ledger.last.pause, 3),
            step=ledger.last.step,
            time=_time(ledger.last.at),
        ),
        earlier=earlier,
    )


def earlier_runs(current: models.Goodput | None, run_id: str) -> models.GoodputTotals | None:
    """The totals of the job's runs before ``run_id``, from the status's ``current``
    goodput: its own earlier runs while it is of ``run_id``, else (the job resumed a
    new run) all of it, this run's included."""
    if current is None:
        return None
    if current.run_id == run_id:
        return current.earlier
    return models.GoodputTotals.model_validate(
        current.model_dump(include=set(models.GoodputTotals.model_fields))
    )


def _no_runs(at: datetime) -> models.GoodputTotals:
    return models.GoodputTotals(
        runs=0,
        wall_seconds=0.0,
        training_seconds=0.0,
        waiting_seconds=0.0,
        startup_seconds=0.0,
        lost_seconds=0.0,
        checkpoint_seconds=0.0,
        longest_pause_seconds=0.0,
        through_time=at,
    )


def _mark(m: Mark) -> models.TimelineMark:
    return models.TimelineMark(
        cause=m.cause,
        since=_time(m.since),
        time=_time(m.at),
        pause_seconds=round(m.pause, 3),
        from_step=m.before,
        step=m.step,
        world=m.world,
    )


def _sum(a: Mapping[str, T], b: Mapping[str, T], digits: int | None = None) -> dict[str, T]:
    out: dict[str, Any] = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + value
    if digits is not None:
        out = {k: round(v, digits) for k, v in out.items()}
    return dict(sorted(out.items()))


def _time(unix: float) -> datetime:
    """To the millisecond: a pause is a fraction of a second."""
    return datetime.fromtimestamp(round(unix, 3), tz=UTC)
