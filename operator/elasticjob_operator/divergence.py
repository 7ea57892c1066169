"""What the job does when its workers found that the ranks trained different models.

Pure: from the divergence records read in the run's etcd
(:class:`elasticjob_runtime.etcd.records.Divergence`, one per step, written by global rank 0
when the fingerprint check failed) to the job's outcome. ``stop`` (the runtime's default)
fails the job with reason ``Diverged`` and the worker's one-line message: replacing the
pods would resume every rank from a checkpoint, consistent again, but with whatever the
script forgot to register silently reset, so a restart is no fix. ``resync`` (opt-in) is a
``Resynced`` warning per record: rank 0's state was copied to every rank and training
went on. Steps only grow within a run, so the last step said is all the memory needed.
The rule ("Divergence") is in docs/operator.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from elasticjob_operator import models
from elasticjob_operator.decision import Event, warning
from elasticjob_runtime.etcd.records import Divergence

FAILED = "Diverged"
RESYNCED = "Resynced"
_MAX_MESSAGE = 1024  # an event stays readable whatever a record holds


@dataclass(frozen=True)
class DivergenceOutcome:
    status: models.Divergences
    events: tuple[Event, ...]  # Resynced warnings
    failure: Event | None  # Diverged: fail the job with it


def decide_divergences(
    said: models.Divergences | None, run: str, reports: Sequence[Divergence], now: datetime
) -> DivergenceOutcome | None:
    """The status, events and failure for the records of run ``run`` newer than the last
    one said; None when there is none."""
    last = said.last_step if said is not None and said.run_id == run else None
    new = sorted((d for d in reports if last is None or d.step > last), key=lambda d: d.step)
    if not new:
        return None
    events = tuple(warning(RESYNCED, message(d)) for d in new if d.action == "resync")
    stops = [d for d in new if d.action == "stop"]
    failure = warning(FAILED, message(stops[0])) if stops else None
    status = models.Divergences(
        count=(said.count if said is not None else 0) + len(new),
        run_id=run,
        last_step=new[-1].step,
        message=failure.message if failure is not None else events[-1].message,
        time=now,
    )
    return DivergenceOutcome(status, events, failure)


def message(record: Divergence) -> str:
    """The worker's own line, with what was done about it."""
    done = (
        "the workers stopped: fix the script and start the job again"
        if record.action == "stop"
        else "rank 0's state was copied to every rank and training went on"
    )
    text = record.message[:_MAX_MESSAGE]
    return f"{record.pod or 'a worker'}: {text} ({done})"
