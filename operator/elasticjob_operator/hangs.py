"""The Warning a job gets when its workers' agents detected a hang, and its count.

Pure: from the hang records read in the run's etcd (:class:`elasticjob_runtime.etcd.records.Hang`,
one per rendezvous round, however many agents noticed) to one ``HangDetected`` event per
record not yet said and ``status.hangs``. Rounds only grow within a run, so the last round
said is all the memory needed, also when old records have expired. The rule ("Hangs") is
in docs/operator.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from elasticjob_operator import models
from elasticjob_operator.decision import Event, warning
from elasticjob_runtime.etcd.records import Hang

REASON = "HangDetected"
# A pod name is at most 253 characters; a record is the runtime's, not the user's, but
# an event must stay readable whatever it holds.
_MAX_POD = 253


def decide_hangs(
    said: models.Hangs | None, run: str, reports: Sequence[Hang], now: datetime
) -> tuple[models.Hangs, list[Event]] | None:
    """The status and one event per hang of run ``run`` newer than the last one said;
    None when there is none."""
    last = said.last_round if said is not None and said.run_id == run else None
    new = sorted((h for h in reports if last is None or h.round > last), key=lambda h: h.round)
    if not new:
        return None
    events = [warning(REASON, hang_message(h)) for h in new]
    status = models.Hangs(
        count=(said.count if said is not None else 0) + len(new),
        run_id=run,
        last_round=new[-1].round,
        message=events[-1].message,
        time=now,
    )
    return status, events


def hang_message(hang: Hang) -> str:
    """What the event says: where, how long, and what was done about it."""
    pod = hang.pod[:_MAX_POD] or "a worker"
    return (
        f"{pod}: no training step for {hang.stalled_seconds:.0f} s after step {hang.step} "
        f"(hangTimeoutSeconds {hang.timeout_seconds:g}, rendezvous round {hang.round}); "
        "the agents restarted the worker group from its last checkpoint, which costs one "
        "of maxRestarts"
    )
