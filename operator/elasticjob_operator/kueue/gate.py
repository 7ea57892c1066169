"""Rule "Queue": what a job in a Kueue queue may do this round. Pure.

A job labelled ``kueue.x-k8s.io/queue-name`` starts no worker until Kueue admits its
Workload, and then at most as many as were admitted. When Kueue evicts or preempts it,
its workers stop (each saves at its next step boundary, as on any SIGTERM) and, once they
are gone, the quota goes back and the Workload waits in its queue again; the next
admission resumes the job from the saved state as a new run, as a resumed suspension
does. None of it counts as a failure or a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from elasticjob_operator.kueue.admission import Admission, State
from elasticjob_operator.kueue.priority import Priority


class Act(StrEnum):
    CREATE = "Create"  # no Workload yet: create it, start nothing
    WAIT = "Wait"  # queued (or the operator has no Kueue): start nothing
    RUN = "Run"  # admitted: run up to ``workers``
    STOP = "Stop"  # evicted: stop the workers
    RELEASE = "Release"  # evicted and the workers are gone: give the quota back


@dataclass(frozen=True)
class Gate:
    act: Act
    workers: int = 0
    reason: str = ""
    message: str = ""


def decide_gate(
    queue: str,
    kueue_enabled: bool,
    admission: Admission | None,
    workers_left: int,
    priority: Priority | None = None,
) -> Gate:
    """``workers_left``: worker pods of the job that still exist (terminating included);
    ``priority``: the class the job names, read while it has no Workload."""
    if not kueue_enabled:
        return Gate(
            Act.WAIT,
            reason="KueueNotEnabled",
            message=f"the job is in Kueue queue {queue!r}, but this operator was installed "
            "without Kueue: install it with --set kueue.enabled=true, or remove the label "
            "kueue.x-k8s.io/queue-name",
        )
    if admission is None and priority is not None and priority.value is None:
        ref = priority.ref
        return Gate(
            Act.WAIT,
            reason="PriorityClassNotFound",
            message=f"the job names {ref.kind} {ref.name!r}, which does not exist: create "
            "it, or name another",
        )
    if admission is None:
        return Gate(
            Act.CREATE, reason="Queued", message=f"waiting for Kueue to admit it in queue {queue!r}"
        )
    if admission.state is State.ADMITTED:
        flavors = f" on flavor {', '.join(admission.flavors)}" if admission.flavors else ""
        return Gate(
            Act.RUN,
            workers=admission.workers,
            reason="Admitted",
            message=f"admitted by ClusterQueue {admission.cluster_queue}: "
            f"{admission.count} of {admission.spec_count} workers{flavors}",
        )
    if admission.state is State.EVICTED:
        why = f"{admission.reason}: {admission.message}" if admission.message else admission.reason
        return Gate(
            Act.STOP if workers_left else Act.RELEASE,
            reason=admission.reason or "Evicted",
            message=f"evicted by Kueue ({why}); waiting to be admitted again",
        )
    detail = f" ({admission.reason}: {admission.message})" if admission.message else ""
    return Gate(
        Act.WAIT,
        reason="Queued",
        message=f"waiting for Kueue to admit it in queue {queue!r}{detail}",
    )
