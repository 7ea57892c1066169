"""What the operator observes of a job, reduced to the facts its decisions use.

Pure functions over raw API objects (a worker pod becomes an :class:`ObservedPod`) and over
the records the runtime publishes in the run's etcd (decoded by
:mod:`elasticjob_runtime.etcd.records`, the very code that encodes them). Nothing here decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from elasticjob_operator import builders, models
from elasticjob_operator.kueue.admission import Admission, Placement
from elasticjob_operator.kueue.priority import Priority
from elasticjob_runtime.etcd import records
from elasticjob_runtime.goodput import ledger
from elasticjob_runtime.goodput.ledger import Ledger

R = TypeVar("R")

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Waiting:
    """A container of the pod that is not running, and the kubelet's reason why."""

    container: str
    reason: str  # the kubelet's CamelCase reason: ContainerCreating, ImagePullBackOff, ...
    message: str = ""


@dataclass(frozen=True)
class ObservedPod:
    """The facts about one worker pod that the decisions use."""

    name: str
    index: int
    phase: str
    terminating: bool = False
    exit_code: int | None = None
    reason: str = ""
    incarnation: int = 0
    foreign: bool = False  # carries our labels but another owner: never touched
    node_lost_since: datetime | None = None  # marked not ready by the node controller
    # metadata.deletionTimestamp: by then the pod's kubelet should have confirmed the delete
    deletion_deadline: datetime | None = None
    waiting: tuple[Waiting, ...] = ()  # init containers first, in the pod's order
    # why the cluster took it (DisruptionTarget's reason, or a kubelet eviction): not the
    # worker's failure, so never charged to backoffLimit; "" for anything else
    disruption: str = ""
    ip: str = ""  # status.podIP: its agent's rendezvous address ("" before it has one)
    uid: str = ""  # metadata.uid: tells it from a replacement of the same name


@dataclass(frozen=True)
class Observed:
    """Everything one round of the decisions sees of the job's world."""

    pods: tuple[ObservedPod, ...] = ()
    services: frozenset[str] = frozenset()
    deployments: frozenset[str] = frozenset()
    network_policies: frozenset[str] = frozenset()
    disruption_budgets: frozenset[str] = frozenset()
    progress: models.Progress | None = None  # None: not read this round, keep the last one
    ledger: Ledger | None = None  # the run's goodput ledger, with progress; None: keep the last
    memory_fallbacks: tuple[records.MemoryFallback, ...] = ()  # this run's reports, if read
    hangs: tuple[records.Hang, ...] = ()  # this run's hang records, if read
    divergences: tuple[records.Divergence, ...] = ()  # this run's divergence records
    admission: Admission | None = None  # the job's Kueue Workload, if it is in a queue
    more: Admission | None = None  # its second one: the workers a partial admission left out
    # where the second one's admitted flavors put the workers it adds
    more_placement: Placement = field(default_factory=Placement)
    priority: Priority | None = None  # the class it names, read while it has no Workload
    # the job's metadata.creationTimestamp (to the second, as the API server keeps it):
    # where its goodput's wall time starts (goodput.run_started)
    created: datetime | None = None
    # where its admitted flavors put the workers
    placement: Placement = field(default_factory=Placement)
    # (index, incarnation) of workers the cluster took, seen only as DELETED (pod_watch.py)
    taken: frozenset[tuple[int, int]] = frozenset()
    # indexes whose pod is gone from the listing before its DELETED event came (pod_watch.py)
    departing: frozenset[int] = frozenset()
    # its kube-scheduler Workload (gang.py): there at all, and its gang's minCount
    gang_workload: bool = False
    gang_min_count: int | None = None


# -- pods ------------------------------------------------------------------------------


def node_lost_since(pod: Obj) -> datetime | None:
    """When the node lifecycle controller marked this pod not ready, or None.

    That controller flips only the Ready condition of the pods on a node that stopped
    answering; the kubelet itself reports Ready False only together with ContainersReady
    False (or, with readiness gates, reason ReadinessGatesNotReady)."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    ready, containers = conds.get("Ready") or {}, conds.get("ContainersReady") or {}
    if (
        ready.get("status") != "False"
        or containers.get("status") != "True"
        or ready.get("reason") == "ReadinessGatesNotReady"
    ):
        return None
    return timestamp(ready.get("lastTransitionTime"))


def timestamp(value: object) -> datetime | None:
    """An RFC 3339 time of the API (``2026-11-23T05:48:23Z``); None if absent or not one."""
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None
    except ValueError:
        return None


def exit_code(pod: Obj) -> int | None:
    """The trainer's exit code: the first container's, else the first non-zero one."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    first = (pod.get("spec") or {}).get("containers") or [{}]
    main = first[0].get("name")
    codes: list[tuple[bool, int]] = []
    for cs in statuses:
        term = (cs.get("state") or {}).get("terminated") or {}
        if "exitCode" in term:
            codes.append((cs.get("name") == main, int(term["exitCode"])))
    for is_main, code in codes:
        if is_main:
            return code
    nonzero = [c for _, c in codes if c != 0]
    return nonzero[0] if nonzero else (codes[0][1] if codes else None)


def waiting(pod: Obj) -> tuple[Waiting, ...]:
    """The pod's containers (init containers first) in a waiting state with a reason."""
    status = pod.get("status") or {}
    out = []
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        state = (cs.get("state") or {}).get("waiting") or {}
        if state.get("reason"):
            message = str(state.get("message") or "")
            out.append(Waiting(str(cs.get("name", "")), str(state["reason"]), message))
    return tuple(out)


# The DisruptionTarget reasons of a pod the cluster took on purpose: a scheduler's
# preemption, the eviction API (kubectl drain, a PodDisruptionBudget-guarded eviction)
# and the kubelet's own termination (node pressure, graceful node shutdown). A lost
# node's taint-manager or pod-GC deletion is not among them: a broken node is a failure.
DISRUPTIONS = frozenset({"PreemptionByScheduler", "EvictionByEvictionAPI", "TerminationByKubelet"})


def disruption_of(pod: Obj) -> str:
    """Why the cluster took this pod on purpose, or "" (see :data:`DISRUPTIONS`)."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            reason = str(cond.get("reason") or "")
            if reason in DISRUPTIONS:
                return reason
    return "Evicted" if status.get("reason") == "Evicted" else ""


def worker_labels(pod: Mapping[str, Any]) -> tuple[int, int] | None:
    """(index, incarnation) a worker pod's labels give; None if it is not a worker."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels[builders.LABEL_INDEX]), int(labels.get(builders.LABEL_INCARNATION, "0"))
    except (KeyError, ValueError):
        return None


def observe_pod(pod: Obj, job_uid: str) -> ObservedPod | None:
    """Reduce a worker pod to the facts the decisions need; None if it is not a worker."""
    meta = pod.get("metadata") or {}
    if (worker := worker_labels(pod)) is None:
        return None
    index, incarnation = worker
    owners = meta.get("ownerReferences") or []
    foreign = not any(o.get("uid") == job_uid for o in owners)
    status = pod.get("status") or {}
    return ObservedPod(
        name=str(meta.get("name", "")),
        index=index,
        phase=str(status.get("phase") or "Pending"),
        terminating=bool(meta.get("deletionTimestamp")),
        deletion_deadline=timestamp(meta.get("deletionTimestamp")),
        exit_code=exit_code(pod),
        reason=str(status.get("reason") or ""),
        incarnation=incarnation,
        foreign=foreign,
        node_lost_since=node_lost_since(pod),
        waiting=waiting(pod),
        disruption=disruption_of(pod),
        ip=str(status.get("podIP") or ""),
        uid=str(meta.get("uid") or ""),
    )


# -- the run's records in etcd ---------------------------------------------------------


def progress_status(record: records.Progress) -> models.Progress:
    """The runtime's progress record as the job's ``status.progress``."""
    published = datetime.fromtimestamp(record.updated, tz=UTC)
    return models.Progress(
        step=record.step,
        epoch=record.epoch,
        world_size=record.world_size,
        samples_per_second=record.samples_per_second,
        checkpoint_step=record.checkpoint_step,
        checkpoint_error=record.checkpoint_error,
        trainer_restarts=record.restart_count,
        update_time=published.replace(microsecond=0),
    )


def progress_of(raw: bytes | None) -> models.Progress | None:
    """The stored progress record as ``status.progress``; None if there is none or it is
    malformed (no progress this round: the status keeps the last one)."""
    if raw is None:
        return None
    try:
        return progress_status(records.decode_progress(raw))
    # OverflowError, OSError: an ``updated`` time past what datetime holds
    except (ValueError, OverflowError, OSError) as exc:
        _malformed("progress record", exc)
        return None


def ledger_of(raw: bytes | None) -> Ledger | None:
    """The goodput ledger in the stored progress record; None if there is none, or it (or
    the record) is malformed: the status keeps the last one."""
    if raw is None:
        return None
    try:
        doc = records.decode_progress(raw).ledger
        if doc is None:
            return None
        decoded = ledger.decode(doc)
        last = decoded.last.at if decoded.last is not None else decoded.through
        for moment in (decoded.opened, decoded.through, last):
            datetime.fromtimestamp(moment, tz=UTC)  # the status holds it as a date
        return decoded
    # OverflowError, OSError: a time past what datetime holds
    except (ValueError, OverflowError, OSError) as exc:
        _malformed("goodput ledger", exc)
        return None


def _decoded(raws: Iterable[bytes], decode: Callable[[bytes], R], what: str) -> tuple[R, ...]:
    """The stored records ``decode`` reads; a malformed one is skipped (and logged)."""
    out = []
    for raw in raws:
        try:
            out.append(decode(raw))
        except ValueError as exc:
            _malformed(what, exc)
    return tuple(out)


def memory_fallbacks_of(raws: Iterable[bytes]) -> tuple[records.MemoryFallback, ...]:
    """The stored node-memory reports; a malformed one is skipped."""
    return _decoded(raws, records.decode_memory_fallback, "node-memory report")


def hangs_of(raws: Iterable[bytes]) -> tuple[records.Hang, ...]:
    """The stored hang records; a malformed one is skipped."""
    return _decoded(raws, records.decode_hang, "hang record")


def divergences_of(raws: Iterable[bytes]) -> tuple[records.Divergence, ...]:
    """The stored divergence records; a malformed one is skipped."""
    return _decoded(raws, records.decode_divergence, "divergence record")


_said: set[str] = set()


def _malformed(what: str, exc: Exception) -> None:
    """Say at debug level, once per fault, that a record was not readable: the runtime
    republishes every few seconds, and a version skew would say so every time."""
    line = f"ignoring a malformed {what} in the run's etcd: {exc}"
    if line in _said:
        return
    if len(_said) >= 100:
        _said.clear()
    _said.add(line)
    log.debug(line)
