"""What Kueue's admission says of a job's Workload, reduced to the facts the rule
"Queue" uses. Pure.

Kueue (v0.17, ``kueue.x-k8s.io/v1beta2``) writes ``status.admission`` and the conditions
``QuotaReserved`` and ``Admitted`` in one write when it admits a Workload, and
``Evicted=True`` (reason ``Preempted``, ``PodsReadyTimeout``, ``Deactivated``, ...) when it
takes the quota back. It never clears the admission of an evicted Workload itself: the
owner stops its pods and then releases the quota (:func:`release_patch`), as Kueue's own
job integrations do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

Obj = dict[str, Any]


class State(StrEnum):
    PENDING = "Pending"  # waiting in its queue (or inadmissible, with Kueue's reason)
    ADMITTED = "Admitted"  # quota reserved and admitted: its workers may run
    EVICTED = "Evicted"  # admitted, then evicted or preempted: stop, then release


@dataclass(frozen=True)
class Placement:
    """Where the admitted flavors put the workers: their ResourceFlavors' ``nodeLabels``
    as a node selector and their ``tolerations``."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Obj, ...] = ()


@dataclass(frozen=True)
class Admission:
    """One observed Workload of the job."""

    workload: str
    resource_version: str
    state: State
    spec_count: int  # the pod set's count when the Workload was created
    count: int = 0  # workers admitted (0 unless admitted or evicted)
    cluster_queue: str = ""
    flavors: tuple[str, ...] = ()
    reason: str = ""  # Kueue's reason for the state (pending: QuotaReserved's; evicted: Evicted's)
    message: str = ""
    reclaimable: int = 0  # status.reclaimablePods for the pod set
    conditions: tuple[Obj, ...] = ()  # as Kueue wrote them: the release rewrites the list

    @property
    def workers(self) -> int:
        """Workers the job may run now: those admitted, less what it gave back."""
        if self.state is not State.ADMITTED:
            return 0
        return max(0, min(self.count, self.spec_count - self.reclaimable))


def _condition(conditions: Iterable[Obj], type_: str) -> Obj | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def _true(conditions: Iterable[Obj], type_: str) -> bool:
    c = _condition(conditions, type_)
    return c is not None and c.get("status") == "True"


def admission_of(workload: Obj, pod_set: str) -> Admission:
    """The facts of one Workload (``pod_set``: the name of the job's one pod set)."""
    meta, spec, status = (
        workload["metadata"],
        workload.get("spec") or {},
        workload.get("status") or {},
    )
    conditions = tuple(status.get("conditions") or ())
    spec_count = next(
        (int(p.get("count", 1)) for p in spec.get("podSets") or () if p.get("name") == pod_set), 0
    )
    reclaimable = next(
        (
            int(p.get("count", 0))
            for p in status.get("reclaimablePods") or ()
            if p.get("name") == pod_set
        ),
        0,
    )
    base = Admission(
        workload=meta["name"],
        resource_version=str(meta.get("resourceVersion", "")),
        state=State.PENDING,
        spec_count=spec_count,
        reclaimable=reclaimable,
        conditions=conditions,
    )
    admission = status.get("admission")
    if not admission or not _true(conditions, "QuotaReserved"):
        pending = _condition(conditions, "QuotaReserved") or {}
        return _with(
            base, reason=str(pending.get("reason", "")), message=str(pending.get("message", ""))
        )
    assignment: Obj = next(
        (a for a in admission.get("podSetAssignments") or () if a.get("name") == pod_set), {}
    )
    count = int(assignment.get("count", spec_count))
    flavors = tuple(sorted(set((assignment.get("flavors") or {}).values())))
    admitted = _with(
        base, count=count, cluster_queue=str(admission.get("clusterQueue", "")), flavors=flavors
    )
    if _true(conditions, "Evicted"):
        evicted = _condition(conditions, "Evicted") or {}
        return _with(
            admitted,
            state=State.EVICTED,
            reason=str(evicted.get("reason", "")),
            message=str(evicted.get("message", "")),
        )
    if not _true(conditions, "Admitted"):  # quota reserved, admission checks still to pass
        return _with(
            admitted, count=0, reason="QuotaReserved", message="waiting for admission checks"
        )
    return _with(admitted, state=State.ADMITTED)


def _with(a: Admission, **changes: Any) -> Admission:
    return replace(a, **changes)


def placement(flavors: Sequence[Obj]) -> Placement:
    """The node selector and tolerations of the admitted ResourceFlavors, as Kueue's own
    integrations apply them (``podset.FromAssignment``)."""
    selector: dict[str, str] = {}
    tolerations: list[Obj] = []
    for flavor in flavors:
        spec = flavor.get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or () if t not in tolerations]
    return Placement(selector, tuple(tolerations))


def _stamp(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def release_patch(a: Admission, now: datetime) -> Obj:
    """The merge patch of ``workloads/status`` that gives an evicted Workload's quota back
    once its workers are gone: no admission, quota no longer reserved, and requeued
    (Kueue backs off before admitting it again when the eviction was not a preemption,
    as for its own jobs). The whole condition list is sent (a merge patch replaces a
    list), guarded by the resourceVersion it was computed from."""
    requeue = a.reason in ("Preempted", "NodeFailures")
    changed = {
        "QuotaReserved": (
            "False",
            "Pending",
            f"the workers stopped after: {a.message or a.reason}",
        ),
        "Admitted": ("False", "NoReservation", "the quota was given back"),
        "Requeued": ("True" if requeue else "False", a.reason or "Evicted", a.message or a.reason),
    }
    conditions: list[Obj] = []
    for c in a.conditions:
        if c.get("type") in changed:
            status, reason, message = changed.pop(c["type"])
            moved = c.get("status") != status
            c = {**c, "status": status, "reason": reason, "message": message}
            if moved:
                c["lastTransitionTime"] = _stamp(now)
        conditions.append(c)
    for type_, (status, reason, message) in changed.items():
        conditions.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": _stamp(now),
            }
        )
    return {
        "metadata": {"resourceVersion": a.resource_version},
        "status": {"admission": None, "conditions": conditions},
    }


def reclaim_patch(a: Admission, desired: int, pod_set: str) -> Obj | None:
    """Quota given back when the job wants fewer workers than were admitted: Kueue counts
    ``min(admitted, count - reclaimable)``, so ``reclaimable`` grows to
    ``count - desired``. It never shrinks while admitted (Kueue holds it monotonic);
    None when nothing changes."""
    wanted = max(0, a.spec_count - desired)
    if a.state is not State.ADMITTED or desired >= a.count or wanted <= a.reclaimable:
        return None
    return {"status": {"reclaimablePods": [{"name": pod_set, "count": wanted}]}}
