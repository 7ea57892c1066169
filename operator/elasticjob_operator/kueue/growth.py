"""Rule "Queue", growing: the workers a partial admission left out, asked for again. Pure.

Kueue cannot grow an admitted Workload of a kind it does not know
(kubernetes-sigs/kueue#13646), so when the job's Workload was admitted with fewer workers
than the job wants, the operator asks for the rest with a second Workload, ``<job>-more``
(``minCount`` 1: any of them is worth starting). When Kueue admits it, the extra workers
start and join the running group in place (a join's pause, nothing more); when Kueue
evicts it, they stop and the job goes on at the size of its first admission. It is
deleted when the job no longer wants more than the first admission gave (and its extra
workers are gone), when the job stops, and with the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from elasticjob_operator.kueue.admission import Admission, State


class Act(StrEnum):
    NONE = "None"  # nothing to ask for, nothing to change
    CREATE = "Create"  # ask for ``count`` more workers
    REPLACE = "Replace"  # the pending request asks for the wrong count: delete it (and ask again)
    DELETE = "Delete"  # no longer wanted (or evicted) and its workers are gone
    KEEP = "Keep"  # requested or admitted: run ``workers`` extra


@dataclass(frozen=True)
class Growth:
    act: Act
    count: int = 0  # CREATE: the workers to ask for
    workers: int = 0  # extra workers the job may run now


def decide_growth(desired: int, base: Admission, more: Admission | None, extra_pods: int) -> Growth:
    """``desired``: the workers the job wants; ``base``: its first Workload, admitted;
    ``more``: the second one, if any; ``extra_pods``: worker pods at indexes at or past
    the base's admitted workers that still exist (terminating included)."""
    wanted = max(0, desired - base.workers)
    if more is None:
        return Growth(Act.CREATE, count=wanted) if wanted else Growth(Act.NONE)
    if more.state is State.EVICTED or (more.state is State.ADMITTED and not wanted):
        # its workers stop first (the round scales down to the base); then its quota goes
        return Growth(Act.NONE if extra_pods else Act.DELETE)
    if more.state is State.PENDING:
        if more.spec_count != wanted:
            return Growth(Act.REPLACE)
        return Growth(Act.KEEP)
    return Growth(Act.KEEP, workers=min(more.workers, wanted))
