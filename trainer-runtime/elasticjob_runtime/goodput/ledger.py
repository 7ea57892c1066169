"""The goodput ledger: where every second of a run went, in exactly one bucket.

Rank 0 keeps it from the step loop's own moments (a commit, a regroup noticed, a
regroup done) and publishes it with the progress record; the operator shows it as the
job's ``status.goodput``. docs/goodput.md defines the buckets and compares them with
Meta's ETT% and Google's goodput/badput. Pure: each function takes a ledger and a
moment and returns the next ledger, so every rule is tested without a clock or a group.

The buckets, in seconds of wall time from :attr:`Ledger.opened` to :attr:`Ledger.through`:

* ``training``: committed steps, at most one typical step's time each for the first
  step after a recovery (the rest of that step waited for the group);
* ``startup``: the run's first start, from its agent's start to the first commit;
* ``paused``, by :class:`Cause`: from a fault noticed to the first step after it, less
  that step's typical time; a group restarted from a checkpoint pauses from the last
  moment its ledger was published to its first commit;
* ``lost``: work done and then thrown away: a step in flight that a fault dropped, and
  a step committed again after a restart went back to a checkpoint;
* ``checkpoint``: the part of the saves the training thread waited for (after a commit).

Beside the buckets the ledger keeps the run's timeline (:class:`Mark`): its start and its
newest recoveries, each with the steps and the group size around it, enough to draw the
run's steps and world size against time (elasticjob_operator/timeline.py).

The operator adds what no rank 0 can see (a job queued or suspended): docs/goodput.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

# How much a normal step's time moves the typical step time (an exponential average):
# a tenth, so one slow step does not make the next recovery look short.
TYPICAL_WEIGHT: Final = 0.1

# Timeline marks kept: the start and the newest recoveries (the record is republished
# every second, and the job's status carries them).
MARKS_KEPT: Final = 32

M = TypeVar("M")  # a timeline mark, of the ledger or of the job's status

# The cause of the first mark: the run's start (from its opening to its first step).
START: Final = "start"


class Cause(enum.StrEnum):
    """Why the training paused, as far as a rank can tell (docs/goodput.md). A newer
    runtime may publish causes an older operator does not know; they are kept and shown
    as they are (:func:`decode` reads any string)."""

    CRASH = "crash"  # a worker process exited (its agent started another in its place)
    NODE_LOST = "node-lost"  # a node was lost or froze (its member lease lapsed)
    HANG = "hang"  # the agents saw the steps stop and restarted the group
    DIVERGENCE = "divergence"  # the ranks' states differed: rank 0's was copied to all
    FAILURE = "failure"  # a collective broke, and the round did not say why
    JOIN = "join"  # a planned regroup that grew the group
    DEPARTURE = "departure"  # a planned regroup that shrank it (a scale-down, a SIGTERM)
    RESTART = "restart"  # the whole group started again (new processes), for no cause said


@dataclass(frozen=True)
class Recovery:
    """A recovery under way: noticed, not yet followed by a committed step."""

    cause: str
    since: float  # unix time of the last commit before it (its pause is counted from there)


@dataclass(frozen=True)
class Recovered:
    """The newest recovery that ended: what the operator says of it in an event."""

    cause: str
    pause: float  # seconds from its last step to the next, less one step
    step: int  # the first step committed after it
    at: float  # unix time of that step


@dataclass(frozen=True)
class Mark:
    """A point of the run's timeline: its start (cause :data:`START`) or a recovery that
    ended. Training stopped at ``since`` at step ``before`` and went on at ``at`` with
    step ``step`` in a group of ``world``; ``pause`` as in :class:`Recovered` (for the
    start: the start-up)."""

    cause: str
    since: float
    at: float
    pause: float
    before: int
    step: int
    world: int


@dataclass(frozen=True)
class Ledger:
    """One run's accounts (seconds); see the module docstring for each bucket."""

    opened: float  # unix time the accounts start (the run's first agent started)
    through: float  # unix time of the last moment booked
    training: float = 0.0
    startup: float = 0.0
    lost: float = 0.0
    checkpoint: float = 0.0
    paused: Mapping[str, float] = field(default_factory=dict)
    recoveries: Mapping[str, int] = field(default_factory=dict)
    longest_pause: float = 0.0
    step: int = 0  # the highest step committed: committing one at or below it again is a redo
    typical_step: float | None = None  # seconds of a normal step (moving average)
    started: bool = False  # a step has been committed (before: the time is startup)
    recovering: Recovery | None = None
    last: Recovered | None = None  # the newest recovery that ended
    world: int = 0  # the group's size since it last formed (0: not formed yet)
    marks: tuple[Mark, ...] = ()  # the start and the newest recoveries, oldest first

    @property
    def wall(self) -> float:
        return self.through - self.opened

    @property
    def accounted(self) -> float:
        """The sum of the buckets: :attr:`wall`, up to float rounding."""
        return (
            self.training + self.startup + self.lost + self.checkpoint + sum(self.paused.values())
        )

    @property
    def goodput(self) -> float | None:
        """Training time over wall time; None before any time has passed."""
        return self.training / self.wall if self.wall > 0 else None


def opened(at: float) -> Ledger:
    """A new run's ledger, its time counted from ``at`` (its first agent's start)."""
    return Ledger(opened=at, through=at)


def committed(ledger: Ledger, step: int, at: float) -> Ledger:
    """Step ``step`` committed at ``at``: the time since the last moment booked is its.
    A time earlier than that (a clock behind another process's) books nothing but the step."""
    work = max(0.0, at - ledger.through)
    redo = step <= ledger.step  # done before, and lost when the group went back to a checkpoint
    booked = replace(ledger, through=max(at, ledger.through), step=max(step, ledger.step))
    if not ledger.started:
        begun = max(at, ledger.opened)  # a clock behind the opener's: no negative start-up
        start = Mark(START, ledger.opened, begun, begun - ledger.opened, 0, step, ledger.world)
        return replace(
            booked, startup=ledger.startup + work, started=True, marks=_marked(ledger, start)
        )
    if ledger.recovering is not None:
        return _recovered(booked, ledger.recovering, work, redo, at, step, ledger.step)
    if redo:
        return replace(booked, lost=ledger.lost + work)
    return replace(
        booked,
        training=ledger.training + work,
        typical_step=typical(ledger.typical_step, work),
    )


def saved(ledger: Ledger, at: float) -> Ledger:
    """The training thread waited for a save (after a commit) until ``at``: checkpoint
    time, or the pause of a recovery under way."""
    if ledger.recovering is not None:
        return paused(ledger, at)
    elapsed = max(0.0, at - ledger.through)
    return replace(ledger, through=max(at, ledger.through), checkpoint=ledger.checkpoint + elapsed)


def finished(ledger: Ledger, at: float) -> Ledger:
    """The run ends at ``at``: a recovery under way (a regroup as training ended) ends
    here, its time a pause, with no step after it."""
    if ledger.recovering is None:
        return ledger
    recovery = ledger.recovering
    pause = max(0.0, at - recovery.since)
    ended = paused(ledger, at)
    ended_at = max(at, recovery.since)
    mark = Mark(
        recovery.cause, recovery.since, ended_at, pause, ledger.step, ledger.step, ledger.world
    )
    return replace(
        ended,
        recovering=None,
        longest_pause=max(ledger.longest_pause, pause),
        marks=_marked(ledger, mark),
    )


def formed(ledger: Ledger, world: int) -> Ledger:
    """The group formed with ``world`` ranks (the timeline's group size from here)."""
    return ledger if ledger.world == world else replace(ledger, world=world)


def _marked(ledger: Ledger, mark: Mark) -> tuple[Mark, ...]:
    """``ledger``'s marks and ``mark``, as many as a timeline keeps (:func:`kept`)."""
    return tuple(kept([*ledger.marks, mark]))


def kept(marks: Sequence[M]) -> list[M]:
    """A timeline's marks as it keeps them, at most :data:`MARKS_KEPT`: the first (the
    start) and the newest. The ledger's and the job's status's (which adds earlier runs)."""
    if len(marks) <= MARKS_KEPT:
        return list(marks)
    return [marks[0], *marks[len(marks) - MARKS_KEPT + 1 :]]


def _recovered(
    booked: Ledger, recovery: Recovery, work: float, redo: bool, at: float, step: int, before: int
) -> Ledger:
    """The first step after a recovery: a typical step's time is the step's own (trained,
    or lost if it is a redo), the rest of it waited for the group: the recovery's pause."""
    # no normal step yet (a fault right after the first): none of it was the step's own
    own = 0.0 if booked.typical_step is None else min(work, booked.typical_step)
    pause = max(0.0, at - recovery.since - own)
    went_on = max(at, recovery.since)  # a clock behind the publisher's: never before it
    mark = Mark(recovery.cause, recovery.since, went_on, pause, before, step, booked.world)
    return replace(
        booked,
        training=booked.training + (0.0 if redo else own),
        lost=booked.lost + (own if redo else 0.0),
        paused=_add(booked.paused, recovery.cause, work - own),
        longest_pause=max(booked.longest_pause, pause),
        recovering=None,
        last=Recovered(recovery.cause, pause, step, at),
        marks=_marked(booked, mark),
    )


def interrupted(ledger: Ledger, cause: str, at: float) -> Ledger:
    """A fault (or a planned regroup) noticed at ``at``: the work since the last commit
    is lost (a planned regroup comes at a step boundary: little or none), and the time
    from here to the first step after it is its pause. One noticed while the run still
    starts, or while a recovery is under way (a regroup tried again), belongs to that:
    its time is booked there and no second recovery is counted."""
    if not ledger.started:
        elapsed = max(0.0, at - ledger.through)
        return replace(ledger, through=max(at, ledger.through), startup=ledger.startup + elapsed)
    if ledger.recovering is not None:
        return paused(ledger, at)
    return replace(
        ledger,
        through=max(at, ledger.through),
        lost=ledger.lost + max(0.0, at - ledger.through),
        recoveries=_add(ledger.recoveries, cause, 1),
        recovering=Recovery(cause, ledger.through),
    )


def paused(ledger: Ledger, at: float) -> Ledger:
    """Book the time up to ``at`` as the pause of the recovery under way (e.g. when the
    regroup is done, or to publish a ledger that is up to date while it lasts)."""
    if ledger.recovering is None:
        return ledger
    elapsed = max(0.0, at - ledger.through)
    return replace(
        ledger,
        through=max(at, ledger.through),
        paused=_add(ledger.paused, ledger.recovering.cause, elapsed),
    )


def restarted(published: Ledger, cause: str) -> Ledger:
    """A new process takes over the ``published`` ledger (its group restarted): the time
    since it was last published is this restart's pause, up to the first commit. (A
    clock behind the publisher's books nothing until it passes the ledger's last moment:
    time is never booked twice.)"""
    if published.recovering is not None or not published.started:
        return published  # the recovery (or the start) goes on
    return replace(
        published,
        recoveries=_add(published.recoveries, cause, 1),
        recovering=Recovery(cause, published.through),
    )


def typical(current: float | None, work: float) -> float:
    """The typical step time after a normal step of ``work`` seconds."""
    if current is None:
        return work
    return current + TYPICAL_WEIGHT * (work - current)


def _add(counts: Mapping[str, Any], key: str, amount: Any) -> dict[str, Any]:
    out = dict(counts)
    out[key] = out.get(key, 0) + amount
    return out


# -- the stored form (inside the progress record) ----------------------------------------


def encode(ledger: Ledger) -> dict[str, Any]:
    """JSON-ready; times rounded to milliseconds (the record is republished every second)."""
    doc: dict[str, Any] = {
        "opened": round(ledger.opened, 3),
        "through": round(ledger.through, 3),
        "training": round(ledger.training, 3),
        "startup": round(ledger.startup, 3),
        "lost": round(ledger.lost, 3),
        "checkpoint": round(ledger.checkpoint, 3),
        "paused": {k: round(v, 3) for k, v in sorted(ledger.paused.items())},
        "recoveries": dict(sorted(ledger.recoveries.items())),
        "longest_pause": round(ledger.longest_pause, 3),
        "step": ledger.step,
        "started": ledger.started,
        "world": ledger.world,
    }
    if ledger.marks:
        # compact (a list per mark, in MARK_FIELDS' order): the record goes out every second
        doc["marks"] = [
            [
                m.cause,
                round(m.since, 3),
                round(m.at, 3),
                round(m.pause, 3),
                m.before,
                m.step,
                m.world,
            ]
            for m in ledger.marks
        ]
    if ledger.typical_step is not None:
        doc["typical_step"] = round(ledger.typical_step, 6)
    if ledger.recovering is not None:
        doc["recovering"] = {"cause": ledger.recovering.cause, "since": ledger.recovering.since}
    if ledger.last is not None:
        last = ledger.last
        doc["last"] = {
            "cause": last.cause,
            "pause": round(last.pause, 3),
            "step": last.step,
            "at": last.at,
        }
    return doc


def decode(doc: object) -> Ledger:
    """Parse a stored ledger; ValueError naming the field if it is not one."""
    if not isinstance(doc, Mapping):
        raise ValueError("ledger: not an object")
    recovering = doc.get("recovering")
    if recovering is not None and not (
        isinstance(recovering, Mapping) and isinstance(recovering.get("cause"), str)
    ):
        raise ValueError("ledger.recovering: not {cause, since}")
    typical = doc.get("typical_step")
    last = doc.get("last")
    if last is not None and not (isinstance(last, Mapping) and isinstance(last.get("cause"), str)):
        raise ValueError("ledger.last: not {cause, pause, step, at}")
    return Ledger(
        world=int(_number(doc, "world")) if "world" in doc else 0,
        marks=_marks(doc.get("marks", [])),
        opened=_seconds(doc, "opened"),
        through=_seconds(doc, "through"),
        training=_seconds(doc, "training"),
        startup=_seconds(doc, "startup"),
        lost=_seconds(doc, "lost"),
        checkpoint=_seconds(doc, "checkpoint"),
        paused=_table(doc, "paused", float),
        recoveries=_table(doc, "recoveries", int),
        longest_pause=_seconds(doc, "longest_pause"),
        step=int(_number(doc, "step")),
        typical_step=None if typical is None else _seconds(doc, "typical_step"),
        started=bool(doc.get("started", True)),
        recovering=None
        if recovering is None
        else Recovery(str(recovering["cause"]), _seconds(recovering, "since")),
        last=None
        if last is None
        else Recovered(
            str(last["cause"]),
            _seconds(last, "pause"),
            int(_number(last, "step")),
            _seconds(last, "at"),
        ),
    )


# The stored form of a Mark: a list of these, in this order.
MARK_FIELDS: Final = ("cause", "since", "at", "pause", "before", "step", "world")


def _marks(stored: object) -> tuple[Mark, ...]:
    if not isinstance(stored, list):
        raise ValueError("ledger.marks: not a list")
    marks = []
    for i, row in enumerate(stored):
        if not (isinstance(row, list) and len(row) == len(MARK_FIELDS) and isinstance(row[0], str)):
            raise ValueError(f"ledger.marks[{i}]: not [{', '.join(MARK_FIELDS)}]")
        fields = dict(zip(MARK_FIELDS, row, strict=True))
        at = f"marks[{i}]"
        marks.append(
            Mark(
                cause=row[0],
                since=_seconds(fields, "since", at),
                at=_seconds(fields, "at", at),
                pause=_seconds(fields, "pause", at),
                before=int(_seconds(fields, "before", at)),
                step=int(_seconds(fields, "step", at)),
                world=int(_seconds(fields, "world", at)),
            )
        )
    return tuple(marks)


def _number(doc: Mapping[str, Any], name: str, within: str = "") -> float:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"ledger.{within}{'.' if within else ''}{name}: not a number ({value!r})")
    return float(value)


def _seconds(doc: Mapping[str, Any], name: str, within: str = "") -> float:
    value = _number(doc, name, within)
    if value < 0:
        raise ValueError(f"ledger.{within}{'.' if within else ''}{name}: negative ({value!r})")
    return value


def _table(doc: Mapping[str, Any], name: str, kind: type[float] | type[int]) -> dict[str, Any]:
    table = doc.get(name, {})
    if not isinstance(table, Mapping):
        raise ValueError(f"ledger.{name}: not an object")
    return {str(k): kind(_seconds(table, k)) for k in table}
