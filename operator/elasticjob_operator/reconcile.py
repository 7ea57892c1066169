"""The operator's decisions: one pure function from what is observed to what should be.

:func:`reconcile` takes the job (spec + its last status), the children observed in the
cluster, the time, and returns the children to create and delete, the new status and the
events to post. It never talks to the cluster, so every rule below is a unit test, and
running it twice on the same input gives the same output (level-based: an operator
restarted mid-job observes the same pods and changes nothing that runs).

Rules
-----
* Children: the headless Service ``<job>-worker``; worker pods ``<job>-worker-<i>`` for
  ``i < replicas``; with no rdzvEndpoint and the etcd-v3 backend, an etcd Deployment and
  Service ``<job>-etcd``.
* A failed or vanished worker is handled by ``restartPolicy``: OnFailure replaces it and
  counts the replacement against ``backoffLimit``; Always replaces it without limit;
  Never retires the index (the job carries on with fewer workers); ExitCode fails the job
  on a trainer exit code 1-127 and otherwise acts as OnFailure. A failed pod is first
  deleted (its name is stable), then re-created once it is gone; ``restartCount`` counts
  re-creations.
* A pod on a lost node: when the node lifecycle controller has marked a pod not ready
  (Ready False while its containers were last reported ready: a kubelet never reports
  that itself) for ``node_lost_grace_seconds``, the node has stopped answering. Its
  kubelet will never confirm a deletion, so the pod is force-deleted (grace 0) and, if it
  was not already being deleted, counted as a failed worker and replaced as above.
  Without this the pod object stays Running (or Terminating) for ever and the index is
  never refilled.
* Scaling: pods at index ``>= replicas`` are deleted (highest index first, since they are
  the ones past the end); missing indexes below it are created.
* Suspend deletes every worker pod and keeps the job; resuming starts a new incarnation
  (a fresh PET_RDZV_ID) and resets startTime.
* Success: a worker that exits 0 means training has finished (torchrun's agent exits 0
  only when its workers returned). From then on nothing is created or replaced; a worker
  that fails or vanishes meanwhile leaves the job with a Warning event. The job is
  Succeeded once every worker still in the job has exited 0.
* Failure: a permanent exit code (ExitCode), the backoff limit spent, activeDeadlineSeconds
  passed since startTime, or fewer than minReplicas workers active for longer than the
  grace period.
* Finished jobs: cleanPodPolicy All deletes every worker pod, Running those still
  pending/running, None none; with All or Running the provisioned etcd goes too. After
  ttlSecondsAfterFinished the job itself is deleted (children follow by owner reference).
* Node memory: when a worker reports that its node-memory checkpoint copy failed (it did
  not fit in /dev/shm), a Warning event says so with the size that would fit, once per
  run (``status.nodeMemoryFallback`` remembers it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal

from elasticjob_operator import builders, models
from elasticjob_operator.builders import JobRef
from elasticjob_operator.models import (
    CleanPodPolicy,
    ConditionType,
    ElasticJobSpec,
    ElasticJobStatus,
    RestartPolicy,
)

Obj = dict[str, Any]
C = ConditionType

ACTIVE_PHASES: Final = frozenset({"Pending", "Running", "Unknown"})
PHASE_ORDER: Final = (
    C.FAILED,
    C.SUCCEEDED,
    C.SUSPENDED,
    C.RESTARTING,
    C.SCALING,
    C.RUNNING,
    C.CREATED,
)


@dataclass(frozen=True)
class Config:
    """Operator-wide settings (from the chart's values)."""

    below_min_grace_seconds: float = 300.0
    node_lost_grace_seconds: float = 10.0


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
    try:
        return datetime.fromisoformat(str(ready["lastTransitionTime"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class MemoryFallbackReport:
    """A worker's report that its node-memory checkpoint copy failed
    (elasticjob_runtime.progress.MemoryFallback, as read from etcd)."""

    pod: str
    step: int
    checkpoint_bytes: int
    shm_bytes: int | None = None
    free_bytes: int | None = None
    no_space: bool = True
    error: str = ""


@dataclass(frozen=True)
class Observed:
    pods: tuple[ObservedPod, ...] = ()
    services: frozenset[str] = frozenset()
    deployments: frozenset[str] = frozenset()
    progress: models.Progress | None = None  # None: not read this round, keep the last one
    memory_fallbacks: tuple[MemoryFallbackReport, ...] = ()  # this run's reports, if read


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class ChildRef:
    kind: Literal["Pod", "Service", "Deployment"]
    name: str
    force: bool = False  # delete with grace 0: no kubelet is left to confirm it


@dataclass
class Decision:
    create: list[Obj] = field(default_factory=list)
    delete: list[ChildRef] = field(default_factory=list)
    status: ElasticJobStatus = field(default_factory=ElasticJobStatus)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False

    def normal(self, reason: str, message: str) -> None:
        self.events.append(Event("Normal", reason, message))

    def warning(self, reason: str, message: str) -> None:
        self.events.append(Event("Warning", reason, message))


# -- observation helpers (pure, over raw API objects) ----------------------------------


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


def observe_pod(pod: Obj, job_uid: str) -> ObservedPod | None:
    """Reduce a worker pod to the facts the decisions need; None if it is not a worker."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        index = int(labels[builders.LABEL_INDEX])
        incarnation = int(labels.get(builders.LABEL_INCARNATION, "0"))
    except (KeyError, ValueError):
        return None
    owners = meta.get("ownerReferences") or []
    foreign = not any(o.get("uid") == job_uid for o in owners)
    status = pod.get("status") or {}
    return ObservedPod(
        name=str(meta.get("name", "")),
        index=index,
        phase=str(status.get("phase") or "Pending"),
        terminating=bool(meta.get("deletionTimestamp")),
        exit_code=exit_code(pod),
        reason=str(status.get("reason") or ""),
        incarnation=incarnation,
        foreign=foreign,
        node_lost_since=node_lost_since(pod),
    )


def progress_from_json(data: Obj, now: datetime) -> models.Progress:
    """Map the runtime's progress record (elasticjob_runtime.progress: snake_case, unix
    ``updated``) onto status.progress; camelCase keys are accepted too."""
    known = {
        "step": "step",
        "epoch": "epoch",
        "world_size": "world_size",
        "worldSize": "world_size",
        "samples_per_second": "samples_per_second",
        "samplesPerSecond": "samples_per_second",
        "checkpoint_step": "checkpoint_step",
        "checkpointStep": "checkpoint_step",
        "restart_count": "trainer_restarts",
    }
    fields: Obj = {}
    for key, value in data.items():
        if key in known and isinstance(value, int | float) and not isinstance(value, bool):
            target = known[key]
            fields[target] = float(value) if target == "samples_per_second" else int(value)
    published = now
    updated = data.get("updated")
    if isinstance(updated, int | float) and not isinstance(updated, bool):
        published = datetime.fromtimestamp(updated, tz=UTC)
    return models.Progress(**fields, update_time=published.replace(microsecond=0))


def memory_fallback_from_json(data: Obj) -> MemoryFallbackReport | None:
    """The runtime's report (snake_case JSON); None if it is not one."""

    def num(name: str) -> int | None:
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return int(value)

    pod, step, size = data.get("pod"), num("step"), num("checkpoint_bytes")
    if not isinstance(pod, str) or not pod or step is None or size is None:
        return None
    return MemoryFallbackReport(
        pod=pod,
        step=step,
        checkpoint_bytes=size,
        shm_bytes=num("shm_bytes"),
        free_bytes=num("free_bytes"),
        no_space=data.get("no_space") is not False,
        error=str(data.get("error") or ""),
    )


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{max(nbytes, 0) / 2**20:.0f} MiB"


def suggested_shm_size(checkpoint_bytes: int) -> str:
    """A /dev/shm limit for this checkpoint: two copies (the newest is written before the
    previous one goes) and a tenth for DataLoader batches, in whole GiB (or 256 MiB steps
    below 1 GiB)."""
    need = checkpoint_bytes * 2.2
    if need <= 2**30:
        return f"{max(1, -(-int(need) // 2**28)) * 256}Mi"
    return f"{-(-int(need) // 2**30)}Gi"


def memory_fallback_message(report: MemoryFallbackReport, spec: ElasticJobSpec) -> str:
    """What the Warning event says: what happened, what it costs, and the fix."""
    shm = ""
    if report.shm_bytes is not None:
        shm = f" in a /dev/shm of {_size(report.shm_bytes)}"
        if report.free_bytes is not None:
            shm += f" ({_size(report.free_bytes)} free)"
    if not report.no_space:
        return (
            f"worker {report.pod}: the node-memory copy of checkpoint step {report.step} "
            f"failed ({report.error}); restarts on that node read the checkpoint directory"
        )
    size = suggested_shm_size(report.checkpoint_bytes)
    template = spec.worker.template.spec.model_dump(mode="json", by_alias=True)
    if template.get("hostIPC"):
        fix = f"free the host's /dev/shm (hostIPC) or make it at least {size}"
    elif builders.owns_shm(template):
        fix = f"give the /dev/shm the pod template mounts at least {size}"
    elif spec.shm_size_bytes == 0:
        fix = f"set spec.shmSize to at least {size} (0 keeps the runtime's 64 MiB /dev/shm)"
    else:
        fix = f"raise spec.shmSize ({spec.shm_size}) to at least {size}"
    return (
        f"worker {report.pod}: checkpoint step {report.step} ({_size(report.checkpoint_bytes)}) "
        f"does not fit{shm}, so restarts on that node read the checkpoint directory "
        f"instead of node memory: {fix}; pods created after the change get it"
    )


def _progress_changed(old: models.Progress | None, new: models.Progress) -> bool:
    """Only a new value counts: re-reading the same step must not rewrite the status."""
    if old is None:
        return True
    return old.model_dump(exclude={"update_time"}) != new.model_dump(exclude={"update_time"})


# -- status helpers --------------------------------------------------------------------


def set_condition(
    status: ElasticJobStatus,
    type_: ConditionType,
    value: bool,
    reason: str,
    message: str,
    now: datetime,
) -> None:
    """Set a condition; lastTransitionTime moves only when True/False flips. A condition
    that was never True is not added just to say False."""
    text: Literal["True", "False"] = "True" if value else "False"
    existing = status.condition(type_)
    if existing is None:
        if not value and type_ not in (C.CREATED, C.RUNNING):
            return
        status.conditions.append(
            models.Condition(
                type=type_,
                status=text,
                reason=reason,
                message=message,
                last_transition_time=now,
            )
        )
        status.conditions.sort(key=lambda c: list(ConditionType).index(c.type))
        return
    if existing.status != text:
        existing.last_transition_time = now
    existing.status = text
    existing.reason = reason
    existing.message = message


def phase_of(status: ElasticJobStatus) -> str:
    for type_ in PHASE_ORDER:
        if status.is_true(type_):
            return type_.value
    return C.CREATED.value


def _fail(d: Decision, reason: str, message: str, now: datetime) -> None:
    st = d.status
    set_condition(st, C.FAILED, True, reason, message, now)
    set_condition(st, C.RUNNING, False, reason, "the job failed", now)
    set_condition(st, C.RESTARTING, False, reason, "the job failed", now)
    set_condition(st, C.SCALING, False, reason, "the job failed", now)
    st.completion_time = now
    st.below_min_since = None
    d.warning(reason, message)


def _succeed(d: Decision, message: str, now: datetime) -> None:
    st = d.status
    set_condition(st, C.SUCCEEDED, True, "AllWorkersSucceeded", message, now)
    set_condition(st, C.RUNNING, False, "AllWorkersSucceeded", "the job succeeded", now)
    set_condition(st, C.RESTARTING, False, "AllWorkersSucceeded", "the job succeeded", now)
    set_condition(st, C.SCALING, False, "AllWorkersSucceeded", "the job succeeded", now)
    st.completion_time = now
    st.below_min_since = None
    d.normal("Succeeded", message)


def _count(st: ElasticJobStatus, pods: list[ObservedPod], deleted: set[str]) -> None:
    mine = [p for p in pods if not p.foreign and p.incarnation == st.incarnation]
    w = st.replica_statuses.worker
    w.active = sum(
        1 for p in mine if p.phase in ACTIVE_PHASES and not p.terminating and p.name not in deleted
    )
    w.succeeded = sum(1 for p in mine if p.phase == "Succeeded")


def _delete_pods(
    d: Decision, pods: list[ObservedPod], deleted: set[str], force: bool = False
) -> list[str]:
    """Delete these pods, highest index first; returns the names."""
    names = []
    for p in sorted(pods, key=lambda p: -p.index):
        if p.foreign or p.terminating or p.name in deleted:
            continue
        d.delete.append(ChildRef("Pod", p.name, force=force))
        deleted.add(p.name)
        names.append(p.name)
    return names


def _finish(
    d: Decision,
    ref: JobRef,
    spec: ElasticJobSpec,
    pods: list[ObservedPod],
    observed: Observed,
    now: datetime,
    deleted: set[str],
    stop_workers: bool = False,
) -> None:
    """Clean up after success/failure per cleanPodPolicy, and honour the TTL."""
    st = d.status
    policy = spec.clean_pod_policy
    if policy is CleanPodPolicy.ALL:
        doomed = pods
    elif policy is CleanPodPolicy.RUNNING or stop_workers:
        doomed = [p for p in pods if p.phase in ACTIVE_PHASES]
    else:
        doomed = []
    names = _delete_pods(d, doomed, deleted)
    if names:
        d.normal("CleanedPods", f"deleted worker pods {', '.join(names)} (cleanPodPolicy {policy})")
    if policy is not CleanPodPolicy.NONE:
        etcd = builders.etcd_name(ref.name)
        if etcd in observed.deployments:
            d.delete.append(ChildRef("Deployment", etcd))
            d.normal("DeletedEtcd", f"deleted the job's etcd {etcd}: the job has finished")
        if etcd in observed.services:
            d.delete.append(ChildRef("Service", etcd))
    ttl = spec.ttl_seconds_after_finished
    done = st.completion_time
    if ttl is not None and done is not None and now >= done + timedelta(seconds=ttl):
        d.delete_job = True
        d.normal("TTLExpired", f"deleting the job {ttl}s after it finished")
    _count(st, pods, deleted)
    st.phase = phase_of(st)


# -- the decision ----------------------------------------------------------------------


def invalid_spec(status: ElasticJobStatus, message: str, now: datetime) -> Decision:
    """A spec that fails the models' rules (it got past the CRD somehow): fail, loudly."""
    d = Decision(status=status.model_copy(deep=True))
    if not d.status.is_true(C.FAILED):
        _fail(d, "InvalidSpec", message, now)
    d.status.phase = phase_of(d.status)
    return d


def reconcile(
    ref: JobRef,
    generation: int | None,
    spec: ElasticJobSpec,
    status: ElasticJobStatus,
    observed: Observed,
    now: datetime,
    config: Config = Config(),
) -> Decision:
    """Everything the operator decides for one job, from what it observed."""
    now = now.replace(microsecond=0)
    st = status.model_copy(deep=True)
    d = Decision(status=st)
    st.observed_generation = generation
    st.selector = builders.selector_string(ref.name)
    if observed.progress is not None and _progress_changed(st.progress, observed.progress):
        st.progress = observed.progress
    run = models.run_id(ref.uid, st.incarnation)  # the run the reports were read for
    said = st.node_memory_fallback
    if observed.memory_fallbacks and (said is None or said.run_id != run):
        first = min(observed.memory_fallbacks, key=lambda r: (r.step, r.pod))
        message = memory_fallback_message(first, spec)
        st.node_memory_fallback = models.NodeMemoryFallback(
            run_id=run,
            pod=first.pod,
            step=first.step,
            checkpoint_bytes=first.checkpoint_bytes,
            shm_bytes=first.shm_bytes,
            message=message,
            time=now,
        )
        d.warning("CheckpointNotInNodeMemory", message)
    pods = sorted(observed.pods, key=lambda p: p.index)
    deleted: set[str] = set()
    desired = spec.desired_replicas

    if st.condition(C.CREATED) is None:
        accepted = "the operator accepted the job"
        set_condition(st, C.CREATED, True, "ElasticJobCreated", accepted, now)
        d.normal(
            "Created",
            f"{desired} workers ({spec.min_replicas}..{spec.effective_max_replicas}), "
            f"rendezvous {spec.rdzv_backend} at {builders.rdzv_endpoint(ref, spec)}",
        )

    if st.finished:
        _finish(d, ref, spec, pods, observed, now, deleted)
        return d

    # -- suspend / resume
    if spec.suspend:
        names = _delete_pods(d, [p for p in pods if not p.terminating], deleted)
        if not st.is_true(C.SUSPENDED):
            set_condition(st, C.SUSPENDED, True, "Suspended", "spec.suspend is true", now)
            d.normal("Suspended", f"deleted worker pods {', '.join(names) or '(none)'}")
        set_condition(st, C.RUNNING, False, "Suspended", "the job is suspended", now)
        set_condition(st, C.RESTARTING, False, "Suspended", "the job is suspended", now)
        set_condition(st, C.SCALING, False, "Suspended", "the job is suspended", now)
        st.worker_indexes = models.WorkerIndexes()
        st.start_time = None
        st.below_min_since = None
        _count(st, pods, deleted)
        st.phase = phase_of(st)
        return d
    if st.is_true(C.SUSPENDED):
        st.incarnation += 1
        st.worker_indexes = models.WorkerIndexes()
        set_condition(st, C.SUSPENDED, False, "Resumed", "spec.suspend is false", now)
        d.normal("Resumed", f"new run {models.run_id(ref.uid, st.incarnation)}")

    if st.start_time is None:
        st.start_time = now

    # -- deadline
    deadline = spec.active_deadline_seconds
    if deadline is not None and now >= st.start_time + timedelta(seconds=deadline):
        why = f"the job ran longer than activeDeadlineSeconds={deadline}"
        _fail(d, "DeadlineExceeded", why, now)
        _finish(d, ref, spec, pods, observed, now, deleted, stop_workers=True)
        return d

    # -- infrastructure children
    if builders.worker_service_name(ref.name) not in observed.services:
        d.create.append(builders.worker_service(ref))
    if spec.provisions_etcd:
        etcd = builders.etcd_name(ref.name)
        if etcd not in observed.deployments:
            d.create.append(builders.etcd_deployment(ref, spec))
            d.normal("ProvisionedEtcd", f"created etcd {etcd} for the rendezvous")
        if etcd not in observed.services:
            d.create.append(builders.etcd_service(ref))

    # -- pods on a lost node: a terminating one is force-deleted (its kubelet is gone);
    # a live one is a failed worker (below)
    lost = {
        p.name
        for p in pods
        if not p.foreign
        and p.node_lost_since is not None
        and (now - p.node_lost_since).total_seconds() >= config.node_lost_grace_seconds
    }
    for gone in pods:
        if gone.name in lost and gone.terminating:
            d.delete.append(ChildRef("Pod", gone.name, force=True))
            d.normal("ForceDeletedPod", f"force-deleted {gone.name}: its node stopped responding")

    # -- pods from an older run or past the end: delete
    stale = [p for p in pods if not p.foreign and p.incarnation != st.incarnation]
    names = _delete_pods(d, stale, deleted)
    if names:
        d.normal("DeletedStalePods", f"deleted pods of an earlier run: {', '.join(names)}")
    idx = st.worker_indexes
    launched, replacing, retired = set(idx.launched), set(idx.replacing), set(idx.retired)
    previous = st.desired_replicas
    scaled = previous is not None and previous != desired
    if scaled:
        verb = "up" if desired > (previous or 0) else "down"
        d.normal("Scaling", f"scaling {verb} from {previous} to {desired} workers")
    st.desired_replicas = desired
    beyond = [p for p in pods if p.index >= desired]
    names = _delete_pods(d, beyond, deleted)
    if names:
        d.normal("ScaledDown", f"deleted worker pods {', '.join(names)}")
    for s in (launched, replacing, retired):
        s.difference_update({i for i in s if i >= desired})

    # -- workers
    current = {p.index: p for p in pods if p.index < desired and p.name not in deleted}
    launched |= {i for i, p in current.items() if not p.foreign and p.incarnation == st.incarnation}
    completing = any(
        p.phase == "Succeeded" and not p.foreign and p.incarnation == st.incarnation
        for p in current.values()
    )
    created: list[str] = []
    replaced = 0
    policy = spec.worker.restart_policy
    failure: tuple[str, str] | None = None

    def create(i: int) -> None:
        d.create.append(builders.worker_pod(ref, spec, i, st.incarnation))
        created.append(builders.worker_pod_name(ref.name, i))
        launched.add(i)

    for i in range(desired):
        if i in retired:
            continue
        p = current.get(i)
        if p is not None and (p.terminating or p.foreign or p.incarnation != st.incarnation):
            continue  # wait for the old pod to go: the name is stable
        on_lost_node = p is not None and p.name in lost
        if p is not None and p.phase != "Failed" and not on_lost_node:
            continue  # pending, running or succeeded
        pod_name = builders.worker_pod_name(ref.name, i)
        if completing:
            retired.add(i)
            if p is None and i not in launched and i not in replacing:
                d.normal("WorkerNotStarted", f"not starting {pod_name}: training has finished")
            else:
                what = "failed" if p is not None else "vanished"
                d.warning(
                    "WorkerLeftAfterCompletion",
                    f"worker {pod_name} {what} after training finished; it leaves the job",
                )
            continue
        if p is None and i in replacing:
            replacing.discard(i)
            create(i)
            st.restart_count += 1
            replaced += 1
            continue
        if p is None and i not in launched:
            create(i)
            continue
        # a failure: the pod failed, or a pod this run created has vanished
        st.replica_statuses.worker.failed += 1
        code = p.exit_code if p is not None else None
        if p is None:
            why = "was deleted"
        elif on_lost_node:
            why = "is on a node that stopped responding"
        elif code is not None:
            why = f"failed with exit code {code}"
        else:
            why = f"failed ({p.reason or 'no exit code'})"
        limit = spec.backoff_limit
        if policy is RestartPolicy.NEVER:
            retired.add(i)
            d.warning(
                "WorkerRetired", f"worker {pod_name} {why}; restartPolicy Never: not replaced"
            )
            continue
        if policy is RestartPolicy.EXIT_CODE and code is not None and 1 <= code <= 127:
            failure = (
                "PermanentError",
                f"worker {pod_name} {why}: a permanent error under restartPolicy ExitCode "
                "(1-127; 128 and above would be retried)",
            )
            break
        if policy is not RestartPolicy.ALWAYS and st.restart_count + len(replacing) >= limit:
            failure = (
                "BackoffLimitExceeded",
                f"worker {pod_name} {why} and backoffLimit={limit} replacements are spent",
            )
            break
        if p is None:
            create(i)
            st.restart_count += 1
            replaced += 1
            d.normal("RestartingWorker", f"worker {pod_name} {why}; replacing it")
        else:
            _delete_pods(d, [p], deleted, force=on_lost_node)
            replacing.add(i)
            d.normal("RestartingWorker", f"worker {pod_name} {why}; deleting it to replace it")

    st.worker_indexes = models.WorkerIndexes(
        launched=sorted(launched), replacing=sorted(replacing), retired=sorted(retired)
    )
    if created:
        d.normal(
            "ReplacedWorkers" if replaced else "CreatedWorkers",
            f"created worker pods {', '.join(created)}",
        )
    if failure is not None:
        _fail(d, *failure, now)
        _finish(d, ref, spec, pods, observed, now, deleted)
        return d

    # -- outcome
    mine = [p for p in current.values() if not p.foreign and p.incarnation == st.incarnation]
    in_job = [i for i in range(desired) if i not in retired]
    by_index = {p.index: p for p in mine}
    if (
        completing
        and in_job
        and all(i in by_index and by_index[i].phase == "Succeeded" for i in in_job)
    ):
        _succeed(d, f"all {len(in_job)} workers still in the job exited 0", now)
        _finish(d, ref, spec, pods, observed, now, deleted)
        return d

    active = len(created) + sum(
        1 for p in mine if p.phase in ACTIVE_PHASES and not p.terminating and p.name not in deleted
    )
    running = sum(1 for p in mine if p.phase == "Running" and not p.terminating)
    if not completing and active < spec.min_replicas:
        since = st.below_min_since or now
        st.below_min_since = since
        grace = config.below_min_grace_seconds
        if (now - since).total_seconds() >= grace:
            _fail(
                d,
                "BelowMinReplicas",
                f"only {active} workers active, fewer than minReplicas={spec.min_replicas}, "
                f"for more than {grace:g}s",
                now,
            )
            _finish(d, ref, spec, pods, observed, now, deleted)
            return d
    else:
        st.below_min_since = None

    # -- conditions
    in_flight = (
        bool(replacing)
        or replaced > 0
        or any(
            i in current and (current[i].terminating or current[i].phase == "Failed")
            for i in in_job
        )
    )
    set_condition(
        st,
        C.RESTARTING,
        in_flight,
        "WorkerReplaced" if in_flight else "WorkersReplaced",
        f"restarts so far: {st.restart_count}",
        now,
    )
    scaling = scaled or any(p.index >= desired for p in pods)
    set_condition(
        st,
        C.SCALING,
        scaling,
        "ScalingWorkers" if scaling else "Scaled",
        f"{desired} workers desired",
        now,
    )
    is_running = running >= spec.min_replicas
    set_condition(
        st,
        C.RUNNING,
        is_running,
        "WorkersRunning" if is_running else "WaitingForWorkers",
        f"{running} of {desired} workers running (minReplicas {spec.min_replicas})",
        now,
    )
    _count(st, pods, deleted)
    st.replica_statuses.worker.active = active
    st.phase = phase_of(st)
    return d
