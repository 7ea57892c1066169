"""What one round of reconciling decides: the job's etcd credentials to make sure of,
children to create and delete, the new status, the events to post. Plain data:
:mod:`elasticjob_operator.reconcile` fills it in, :mod:`elasticjob_operator.job_round`
carries it out (the Kubernetes part through :mod:`elasticjob_operator.kube`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from elasticjob_operator.models import ElasticJobStatus

Obj = dict[str, Any]


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    # The children ("Kind/name") whose creation, and those whose deletion, this event
    # reports: it is posted once that is done even when the round stops at a later child
    # (the next round would not do it again, so it would never say so).
    reports: tuple[str, ...] = ()
    reports_deleted: tuple[str, ...] = ()


def normal(
    reason: str,
    message: str,
    reports: tuple[str, ...] = (),
    reports_deleted: tuple[str, ...] = (),
) -> Event:
    return Event("Normal", reason, message, reports, reports_deleted)


def child_key(obj: Obj) -> str:
    """How an event names a child it reports: ``Kind/name``."""
    return f"{obj['kind']}/{obj['metadata']['name']}"


def reported(events: list[Event], created: set[str], deleted: set[str]) -> list[Event]:
    """The events a round that stopped early still posts: those reporting only children it
    did create and delete (their :func:`child_key`)."""
    return [
        e
        for e in events
        if (e.reports or e.reports_deleted)
        and created.issuperset(e.reports)
        and deleted.issuperset(e.reports_deleted)
    ]


def warning(reason: str, message: str) -> Event:
    return Event("Warning", reason, message)


@dataclass(frozen=True)
class ChildRef:
    kind: Literal["Pod", "Service", "Deployment", "Workload", "GangWorkload"]
    name: str
    force: bool = False  # delete with grace 0: no kubelet is left to confirm it

    @property
    def key(self) -> str:
        """How an event names it (:func:`child_key`)."""
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class Credentials:
    """The job's etcd certificates, made sure of before any child is created: its Secrets
    (looked at again when a child that mounts them is created, so a client Secret deleted
    mid-job is issued again) and, on the shared etcd, first its user there, whom its
    certificate names."""

    recheck: bool
    shared: bool


@dataclass
class Decision:
    credentials: Credentials | None = None
    create: list[Obj] = field(default_factory=list)
    delete: list[ChildRef] = field(default_factory=list)
    status: ElasticJobStatus = field(default_factory=ElasticJobStatus)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    # merge patches of the job's Kueue Workloads' status by name (quota given back),
    # after the children and before the job's status
    workload_status: dict[str, Obj] = field(default_factory=dict)
    # the IPs of running workers this round deletes in a scale-down: their nodes are
    # marked leaving in the run's etcd, in one transaction, before any is deleted, so the
    # others regroup once (etcd/leaving.py)
    leaving: list[str] = field(default_factory=list)
    # the part of ``status`` written before any child is created (a merge patch): what
    # the children embody and every later round must read back, so a round that stops
    # after its first child (a refusal, a conflict, a crash) cannot lose it, and a job
    # says how its workers are placed as soon as one exists (reconcile.status_first)
    status_first: Obj = field(default_factory=dict)

    def normal(
        self,
        reason: str,
        message: str,
        reports: tuple[str, ...] = (),
        reports_deleted: tuple[str, ...] = (),
    ) -> None:
        self.events.append(normal(reason, message, reports, reports_deleted))

    def warning(self, reason: str, message: str) -> None:
        self.events.append(warning(reason, message))
