"""The operator's decisions for one job: from what is observed to what should be.

:func:`reconcile` takes the job (spec + its last status), its children as observed, the
time, and returns a :class:`~elasticjob_operator.decision.Decision`: children to create
and delete, the new status, the events to post. It is a short composition of small pure
decisions that each return a value (:func:`decide_scaling`, the per-index
:func:`~elasticjob_operator.workers.decide_worker`, :func:`decide_outcome`,
:func:`decide_finish`), applied to the Decision in order. It never talks to the cluster,
so every rule is a unit test, and running it twice on the same input gives the same output
(level-based: an operator restarted mid-job observes the same pods and changes nothing that
runs).

The rules themselves are written down once, for users, in docs/operator.md ("The rules");
each decision's docstring names the rule it implements.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from elasticjob_operator import builders, gang, models, network_policy
from elasticjob_operator.builders import JobRef
from elasticjob_operator.checkpoint_volume import durability_warning
from elasticjob_operator.conditions import ConditionChange, phase_of, set_condition
from elasticjob_operator.decision import (
    ChildRef,
    Credentials,
    Decision,
    Event,
    child_key,
    normal,
    warning,
)
from elasticjob_operator.divergence import decide_divergences
from elasticjob_operator.etcd.shared import SharedEtcd, serves
from elasticjob_operator.goodput import (
    earlier_runs,
    goodput_status,
    recovery_event,
    run_started,
)
from elasticjob_operator.hangs import decide_hangs
from elasticjob_operator.kueue import workload as kueue_workload
from elasticjob_operator.kueue.admission import reclaim_patch, release_patch
from elasticjob_operator.kueue.gate import Act as QueueAct
from elasticjob_operator.kueue.gate import Gate, decide_gate
from elasticjob_operator.kueue.growth import Act as GrowthAct
from elasticjob_operator.kueue.growth import decide_growth
from elasticjob_operator.models import CleanPodPolicy, ConditionType, ElasticJobSpec
from elasticjob_operator.network_policy import OperatorPeer
from elasticjob_operator.node_memory import decide_memory_fallback
from elasticjob_operator.observe import Observed, ObservedPod
from elasticjob_operator.pod_start_failures import decide_start_failures
from elasticjob_operator.refusals import created_status
from elasticjob_operator.workers import (
    CREATES,
    RESTARTS,
    Act,
    WorkerAction,
    WorkerContext,
    decide_workers,
    worker_context,
)

C = ConditionType

ACTIVE_PHASES: Final = frozenset({"Pending", "Running", "Unknown"})


@dataclass(frozen=True)
class Config:
    """Operator-wide settings (from the chart's values)."""

    below_min_grace_seconds: float = 300.0
    node_lost_grace_seconds: float = 10.0
    # seconds between the agents' liveness probes: a frozen agent is killed after three
    agent_liveness_period_seconds: int = builders.LIVENESS_PERIOD_SECONDS
    # the operator's pods, whom the etcd's policy admits; None: no NetworkPolicies
    network_policy: OperatorPeer | None = None
    # the chart's one etcd for every job (sharedEtcd.enabled); None: an etcd per job
    shared_etcd: SharedEtcd | None = None
    # jobs in a Kueue queue are admitted by Kueue (kueue.enabled; rule "Queue")
    kueue: bool = False
    # new jobs' workers are placed as a gang by kube-scheduler (gangScheduling; gang.py)
    gang: bool = False


# -- the decisions (pure, each returns a value) ----------------------------------------


def deletable(pods: Iterable[ObservedPod], going: frozenset[str]) -> list[ObservedPod]:
    """The pods of these that a deletion would touch, highest index first: never a pod of
    another owner, one already terminating or one this round already deletes."""
    return sorted(
        (p for p in pods if not p.foreign and not p.terminating and p.name not in going),
        key=lambda p: -p.index,
    )


def lost_pods(pods: Iterable[ObservedPod], now: datetime, grace: float) -> frozenset[str]:
    """Rule "Worker on a lost node": ours, and marked not ready by the node controller
    ``grace`` seconds ago, or still terminating ``grace`` seconds past its deletion
    deadline (the kubelet that would have confirmed the delete is gone)."""

    def since(p: ObservedPod) -> list[datetime]:
        marks = [p.node_lost_since] if p.node_lost_since is not None else []
        if p.terminating and p.deletion_deadline is not None:
            marks.append(p.deletion_deadline)
        return marks

    return frozenset(
        p.name
        for p in pods
        if not p.foreign and any((now - t).total_seconds() >= grace for t in since(p))
    )


@dataclass(frozen=True)
class Scaling:
    event: Event | None  # "scaling up from 2 to 4 workers", when replicas changed
    past_end: tuple[ObservedPod, ...]  # pods at an index >= replicas: they go
    in_progress: bool  # the Scaling condition


def decide_scaling(previous: int | None, desired: int, pods: Sequence[ObservedPod]) -> Scaling:
    """Rule "Scaling": ``previous`` is the replicas of the last round (None: none yet)."""
    event = None
    if previous is not None and previous != desired:
        verb = "up" if desired > previous else "down"
        event = normal("Scaling", f"scaling {verb} from {previous} to {desired} workers")
    past_end = tuple(p for p in pods if p.index >= desired)
    return Scaling(event, past_end, event is not None or bool(past_end))


def leaving_ips(pods: Iterable[ObservedPod], deleted: Iterable[str]) -> list[str]:
    """Rule "Scaling", going down: the IPs of the running pods among ``deleted``. Their
    agents may be training, so their nodes are marked leaving together before the pods
    go; the kubelets' SIGTERMs come one after the other, and each would cost the others
    a regroup of its own."""
    names = frozenset(deleted)
    return sorted(p.ip for p in pods if p.name in names and p.ip and p.phase == "Running")


@dataclass(frozen=True)
class Finish:
    pods: tuple[ObservedPod, ...]  # worker pods to delete, highest index first
    children: tuple[ChildRef, ...]  # the provisioned etcd's Deployment and Service
    delete_job: bool  # ttlSecondsAfterFinished has passed
    events: tuple[Event, ...]


def decide_finish(
    ref: JobRef,
    spec: ElasticJobSpec,
    pods: Sequence[ObservedPod],
    observed: Observed,
    going: frozenset[str],
    completion_time: datetime | None,
    now: datetime,
    stop_workers: bool = False,
) -> Finish:
    """Rule "After the end": clean up per cleanPodPolicy, honour the TTL. ``stop_workers``
    (a deadline) deletes running workers whatever the policy says."""
    policy = spec.clean_pod_policy
    if policy is CleanPodPolicy.ALL:
        doomed = deletable(pods, going)
    elif policy is CleanPodPolicy.RUNNING or stop_workers:
        doomed = deletable((p for p in pods if p.phase in ACTIVE_PHASES), going)
    else:
        doomed = []
    events = []
    if doomed:
        names = ", ".join(p.name for p in doomed)
        events.append(
            normal("CleanedPods", f"deleted worker pods {names} (cleanPodPolicy {policy})")
        )
    children = []
    if policy is not CleanPodPolicy.NONE:
        etcd = builders.etcd_name(ref.name)
        if etcd in observed.deployments:
            children.append(ChildRef("Deployment", etcd))
            events.append(
                normal("DeletedEtcd", f"deleted the job's etcd {etcd}: the job has finished")
            )
        if etcd in observed.services:
            children.append(ChildRef("Service", etcd))
    ttl = spec.ttl_seconds_after_finished
    expired = (
        ttl is not None
        and completion_time is not None
        and seconds_since(completion_time, now) >= ttl
    )
    if expired:
        events.append(normal("TTLExpired", f"deleting the job {ttl}s after it finished"))
    return Finish(tuple(doomed), tuple(children), expired, tuple(events))


class Verdict(StrEnum):
    SUCCEEDED = "succeeded"
    BELOW_MIN = "below-min"  # fewer than minReplicas active for longer than the grace
    RUNNING = "running"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    message: str = ""  # why it succeeded or failed
    active: int = 0  # workers pending or running, counting the ones created this round
    below_min_since: datetime | None = None
    conditions: tuple[ConditionChange, ...] = ()  # RUNNING: Restarting, Scaling, Running


@dataclass(frozen=True)
class WorkerRound:
    """The workers' part of a round, as decided."""

    current: Mapping[int, ObservedPod]  # each index's pod, before the actions
    actions: tuple[WorkerAction, ...]
    ctx: WorkerContext  # after the actions
    going: frozenset[str]  # pods this round deletes
    scaling: bool  # the Scaling condition

    @property
    def failure(self) -> Event | None:
        return next((a.event for a in self.actions if a.act is Act.FAIL_JOB), None)


def decide_outcome(
    spec: ElasticJobSpec,
    workers: WorkerRound,
    below_min_since: datetime | None,
    now: datetime,
    grace: float,
    waiting: str = "",
) -> Outcome:
    """Rules "Success" and "Failure" (below minReplicas), else the running conditions
    (``waiting``: the workers the kubelet cannot start, rule "Stuck workers")."""
    desired, ctx, current = spec.desired_replicas, workers.ctx, workers.current
    mine = [p for p in current.values() if ctx.of_run(p)]
    in_job = [i for i in range(desired) if i not in ctx.retired]
    by_index = {p.index: p for p in mine}
    if (
        ctx.completing
        and in_job
        and all(i in by_index and by_index[i].phase == "Succeeded" for i in in_job)
    ):
        return Outcome(Verdict.SUCCEEDED, f"all {len(in_job)} workers still in the job exited 0")
    active = sum(a.act in CREATES for a in workers.actions) + sum(
        1
        for p in mine
        if p.phase in ACTIVE_PHASES and not p.terminating and p.name not in workers.going
    )
    since = None
    if not ctx.completing and active < spec.min_replicas:
        since = below_min_since or now
        if (now - since).total_seconds() >= grace:
            message = (
                f"only {active} workers active, fewer than minReplicas={spec.min_replicas}, "
                f"for more than {grace:g}s"
            )
            return Outcome(Verdict.BELOW_MIN, message, active)
    conditions = running_conditions(spec, workers, waiting)
    return Outcome(Verdict.RUNNING, "", active, since, conditions)


def running_conditions(
    spec: ElasticJobSpec, workers: WorkerRound, waiting: str = ""
) -> tuple[ConditionChange, ...]:
    """Restarting (a replacement under way), Scaling, and Running (minReplicas running;
    its message names the workers that ``waiting`` describes)."""
    desired, ctx, current = spec.desired_replicas, workers.ctx, workers.current
    in_job = [i for i in range(desired) if i not in ctx.retired]
    in_flight = (
        bool(ctx.replacing)
        or any(a.act in RESTARTS for a in workers.actions)
        or any(
            i in current and (current[i].terminating or current[i].phase == "Failed")
            for i in in_job
        )
    )
    running = sum(
        1 for p in current.values() if ctx.of_run(p) and p.phase == "Running" and not p.terminating
    )
    is_running = running >= spec.min_replicas
    counted = f"{running} of {desired} workers running (minReplicas {spec.min_replicas})"
    return (
        ConditionChange(
            C.RESTARTING,
            in_flight,
            "WorkerReplaced" if in_flight else "WorkersReplaced",
            f"restarts so far: {ctx.restart_count}",
        ),
        ConditionChange(
            C.SCALING,
            workers.scaling,
            "ScalingWorkers" if workers.scaling else "Scaled",
            f"{desired} workers desired",
        ),
        ConditionChange(
            C.RUNNING,
            is_running,
            "WorkersRunning" if is_running else "WaitingForWorkers",
            f"{counted}; {waiting}" if waiting else counted,
        ),
    )


# -- applying them to a Decision -------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One round's inputs, shared by the steps below."""

    ref: JobRef
    spec: ElasticJobSpec
    observed: Observed
    pods: tuple[ObservedPod, ...]  # sorted by index
    now: datetime
    config: Config
    shared: str | None = None  # the shared etcd's endpoint if the job rendezvouses there
    queue: str | None = None  # the Kueue LocalQueue the job names (rule "Queue")
    first_admitted: int | None = None  # the workers its first Workload admitted, once it ran

    @property
    def own_etcd(self) -> bool:
        """The operator runs an etcd for this job alone."""
        return self.spec.provisions_etcd and self.shared is None


def pod_keys(names: Iterable[str]) -> tuple[str, ...]:
    """What an event reporting these pods' deletion names (decision.Event.reports)."""
    return tuple(ChildRef("Pod", name).key for name in names)


def _delete_pods(
    d: Decision, pods: Iterable[ObservedPod], going: frozenset[str] = frozenset()
) -> list[str]:
    """Delete those of these pods that can be (:func:`deletable`); returns their names."""
    doomed = deletable(pods, going)
    d.delete += [ChildRef("Pod", p.name) for p in doomed]
    return [p.name for p in doomed]


def _count(d: Decision, pods: Sequence[ObservedPod], going: frozenset[str]) -> None:
    """status.replicaStatuses.Worker: this run's pods active (not going) and succeeded."""
    st = d.status
    mine = [p for p in pods if not p.foreign and p.incarnation == st.incarnation]
    w = st.replica_statuses.worker
    w.active = sum(
        1 for p in mine if p.phase in ACTIVE_PHASES and not p.terminating and p.name not in going
    )
    w.succeeded = sum(1 for p in mine if p.phase == "Succeeded")


def _end(d: Decision, type_: ConditionType, reason: str, message: str, now: datetime) -> None:
    """The job has succeeded or failed: that condition, and the running ones off."""
    st = d.status
    done = "the job failed" if type_ is C.FAILED else "the job succeeded"
    set_condition(st, type_, True, reason, message, now)
    for other in (C.RUNNING, C.RESTARTING, C.SCALING):
        set_condition(st, other, False, reason, done, now)
    st.completion_time = now
    st.below_min_since = None


def _fail(d: Decision, event: Event, now: datetime) -> None:
    _end(d, C.FAILED, event.reason, event.message, now)
    d.warning(event.reason, event.message)


def _succeed(d: Decision, message: str, now: datetime) -> None:
    _end(d, C.SUCCEEDED, "AllWorkersSucceeded", message, now)
    d.normal("Succeeded", message)


def _finish(d: Decision, r: Round, going: frozenset[str], stop_workers: bool = False) -> Decision:
    """A finished job: apply :func:`decide_finish`, count, set the phase."""
    st = d.status
    finish = decide_finish(
        r.ref, r.spec, r.pods, r.observed, going, st.completion_time, r.now, stop_workers
    )
    d.delete += [ChildRef("Pod", p.name) for p in finish.pods]
    d.delete += finish.children
    d.events += finish.events
    d.delete_job = finish.delete_job
    _delete_workloads(d, r, first=True)  # rule "Queue": the quota goes back
    _count(d, r.pods, going | {p.name for p in finish.pods})
    st.phase = phase_of(st)
    return d


def _observe(d: Decision, r: Round, generation: int | None) -> Event | None:
    """What every round records: the generation acted on, the scale selector, what the
    runtime published (progress, rules "Node memory", "Hangs" and "Divergence"), and the
    Created condition. Returns the failure a divergence calls for, if any."""
    st, spec, ref, now = d.status, r.spec, r.ref, r.now
    st.observed_generation = generation
    st.selector = builders.selector_string(ref.name)
    new = r.observed.progress
    if new is not None and (
        st.progress is None  # only a new value rewrites the status, not a republished one
        or st.progress.model_dump(exclude={"update_time"})
        != new.model_dump(exclude={"update_time"})
    ):
        st.progress = new
    run = models.run_id(ref.uid, st.incarnation)  # the run the reports were read for
    if r.observed.ledger is not None:
        previous = st.goodput if st.goodput is not None and st.goodput.run_id == run else None
        recovered = recovery_event(previous, r.observed.ledger)
        if recovered is not None:
            d.events.append(recovered)
        earlier = earlier_runs(st.goodput, run)
        started = run_started(st, r.observed.created)
        st.goodput = goodput_status(r.observed.ledger, started, run, earlier)
    said = decide_memory_fallback(
        st.node_memory_fallback, run, r.observed.memory_fallbacks, spec, now
    )
    if said is not None:
        st.node_memory_fallback, event = said
        d.events.append(event)
    hung = decide_hangs(st.hangs, run, r.observed.hangs, now)  # rule "Hangs"
    if hung is not None:
        st.hangs, events = hung
        d.events += events
    failure = None
    diverged = decide_divergences(st.divergences, run, r.observed.divergences, now)
    if diverged is not None:  # rule "Divergence"
        st.divergences, failure = diverged.status, diverged.failure
        d.events += diverged.events
    if st.condition(C.CREATED) is None:
        set_condition(
            st, C.CREATED, True, "ElasticJobCreated", "the operator accepted the job", now
        )
        d.normal(
            "Created",
            f"{spec.desired_replicas} workers "
            f"({spec.min_replicas}..{spec.effective_max_replicas}), "
            f"rendezvous {spec.rdzv_backend} at {builders.rdzv_endpoint(ref, spec, r.shared)}",
        )
    return failure


def _suspend(
    d: Decision,
    r: Round,
    reason: str = "Suspended",
    why: str = "spec.suspend is true",
    evicted: bool = False,
) -> Decision:
    """Rule "Suspend": every worker pod goes, the job stays (also when Kueue evicts it,
    rule "Queue": ``evicted``). A suspended job in a queue gives its quota back with its
    Workload; an evicted one releases its first Workload once the pods are gone."""
    st = d.status
    names = _delete_pods(d, r.pods)
    if not st.is_true(C.SUSPENDED):
        set_condition(st, C.SUSPENDED, True, reason, why, r.now)
        d.normal(reason, f"{why}: deleted worker pods {', '.join(names) or '(none)'}")
    _delete_workloads(d, r, first=not evicted)
    for type_ in (C.RUNNING, C.RESTARTING, C.SCALING):
        set_condition(st, type_, False, "Suspended", "the job is suspended", r.now)
    st.worker_indexes = models.WorkerIndexes()
    st.start_time = None
    st.below_min_since = None
    st.stuck_workers = None  # the next run's pods have the same names
    _count(d, r.pods, frozenset(names))
    st.phase = phase_of(st)
    return d


def _resume(d: Decision, r: Round) -> None:
    """Rule "Suspend", the way back: a new run with a fresh rendezvous id."""
    st = d.status
    st.incarnation += 1
    st.worker_indexes = models.WorkerIndexes()
    why = "admitted again" if r.queue is not None else "spec.suspend is false"
    set_condition(st, C.SUSPENDED, False, "Resumed", why, r.now)
    d.normal("Resumed", f"new run {models.run_id(r.ref.uid, st.incarnation)}")


def _queued(d: Decision, r: Round, gate: Gate) -> Decision:
    """Rule "Queue" while the job may not run: its Workload created; after an eviction
    its workers stopped as on a suspension, then its quota given back. Queued says why
    it waits."""
    st, admission = d.status, r.observed.admission
    if gate.act is QueueAct.CREATE:
        assert r.queue is not None
        d.create.append(
            kueue_workload.workload(r.ref, r.spec, r.queue, st.incarnation, r.observed.priority)
        )
    if gate.act in (QueueAct.STOP, QueueAct.RELEASE):
        _suspend(d, r, gate.reason, gate.message, evicted=True)
        if gate.act is QueueAct.RELEASE and admission is not None:
            d.workload_status[admission.workload] = release_patch(admission, r.now)
    elif not st.is_true(C.QUEUED):
        if gate.reason in ("KueueNotEnabled", "PriorityClassNotFound"):
            d.warning(gate.reason, gate.message)
        else:
            d.normal("Queued", gate.message)
    set_condition(st, C.QUEUED, True, gate.reason, gate.message, r.now)
    set_condition(st, C.ADMITTED, False, gate.reason, gate.message, r.now)
    for type_ in (C.RUNNING, C.RESTARTING, C.SCALING):
        set_condition(st, type_, False, "Queued", "the job waits for Kueue", r.now)
    st.admitted_replicas = 0
    _count(d, r.pods, frozenset(c.name for c in d.delete if c.kind == "Pod"))
    st.phase = phase_of(st)
    return d


def _admitted(d: Decision, r: Round, gate: Gate) -> Round:
    """Rule "Queue" once admitted: Admitted says by whom and how many; the round goes on
    with the job wanting at most the admitted workers, placed on the admitted flavors.
    Workers a partial admission left out are asked for with a second Workload
    (kueue/growth.py); a scale-down below what was admitted gives the rest back."""
    st, base, more = d.status, r.observed.admission, r.observed.more
    assert base is not None and r.queue is not None
    desired = r.spec.desired_replicas
    extra_pods = sum(1 for p in r.pods if not p.foreign and p.index >= gate.workers)
    growth = decide_growth(desired, base, more, extra_pods)
    if growth.act is GrowthAct.CREATE:
        d.create.append(
            kueue_workload.workload(
                r.ref, r.spec, r.queue, st.incarnation, r.observed.priority, more=growth.count
            )
        )
    elif growth.act in (GrowthAct.REPLACE, GrowthAct.DELETE) and more is not None:
        d.delete.append(ChildRef("Workload", more.workload))
    workers = gate.workers + growth.workers
    message = gate.message
    if growth.workers:
        message += f", and {growth.workers} more by a second admission"
    elif growth.act in (GrowthAct.CREATE, GrowthAct.KEEP) and desired > gate.workers:
        message += f"; asking Kueue for {desired - gate.workers} more"
    if not st.is_true(C.ADMITTED) or (st.admitted_replicas or 0) < workers:
        d.normal("Admitted", message)
    set_condition(st, C.ADMITTED, True, gate.reason, message, r.now)
    set_condition(st, C.QUEUED, False, gate.reason, message, r.now)
    st.admitted_replicas = workers
    for a, wanted in ((base, desired), (more, desired - gate.workers)):
        patch = reclaim_patch(a, wanted, kueue_workload.POD_SET) if a is not None else None
        if a is not None and patch is not None and wanted > 0:
            d.workload_status[a.workload] = patch
    return replace(r, spec=r.spec.capped(workers), first_admitted=gate.workers)


def _delete_workloads(d: Decision, r: Round, first: bool) -> None:
    """The job's Workloads go (the quota with them): the second one always, the first
    one if ``first``."""
    for a in (r.observed.admission if first else None, r.observed.more):
        if a is not None:
            d.delete.append(ChildRef("Workload", a.workload))


def _provision(d: Decision, r: Round) -> None:
    """The NetworkPolicies (first: no pod of the job is ever unguarded), the headless
    worker Service, the workers' PodDisruptionBudget if asked for and, unless the job
    brings its own, the etcd."""
    ref, observed = r.ref, r.observed
    if r.config.network_policy is not None:
        for policy in network_policy.policies(ref, r.config.network_policy, r.own_etcd):
            if policy["metadata"]["name"] not in observed.network_policies:
                d.create.append(policy)
    if builders.worker_service_name(ref.name) not in observed.services:
        service = builders.worker_service(ref)
        d.create.append(service)  # once per job: its checkpoints' durability is said then
        said = durability_warning(r.spec.worker.template.spec, (child_key(service),))
        if said is not None:
            d.events.append(said)
    budget = builders.disruption_budget_name(ref.name)
    if r.spec.pod_disruption_budget and budget not in observed.disruption_budgets:
        d.create.append(builders.disruption_budget(ref, r.spec))
    if gang.in_use(d.status.placement, r.config.gang):
        plan = gang.decide(r.spec.min_replicas, observed.gang_min_count, observed.gang_workload)
        if plan.replace:
            d.delete.append(ChildRef(gang.KIND_KEY, gang.workload_name(ref.name)))
        if plan.create:
            d.create.append(gang.workload(ref, r.spec.min_replicas))
    if r.own_etcd:
        etcd = builders.etcd_name(ref.name)
        if etcd not in observed.deployments:
            deployment = builders.etcd_deployment(ref, r.spec)
            d.create.append(deployment)
            d.normal(
                "ProvisionedEtcd",
                f"created etcd {etcd} for the rendezvous",
                reports=(child_key(deployment),),
            )
        if etcd not in observed.services:
            d.create.append(builders.etcd_service(ref))


def _tidy(d: Decision, r: Round, lost: frozenset[str], scaling: Scaling) -> frozenset[str]:
    """Pods that go whatever the workers' decisions: a terminating one on a lost node is
    force-deleted (no kubelet will confirm it), an earlier run's and those past the end
    are deleted. Returns the names deleted (a force-deleted pod, already terminating,
    holds its name until it is gone)."""
    for p in r.pods:
        if p.name in lost and p.terminating:
            child = ChildRef("Pod", p.name, force=True)
            d.delete.append(child)
            d.normal(
                "ForceDeletedPod",
                f"force-deleted {p.name}: its node stopped responding",
                reports_deleted=(child.key,),
            )
    incarnation = d.status.incarnation
    stale = _delete_pods(d, (p for p in r.pods if p.incarnation != incarnation))
    if stale:
        d.normal(
            "DeletedStalePods",
            f"deleted pods of an earlier run: {', '.join(stale)}",
            reports_deleted=pod_keys(stale),
        )
    if scaling.event is not None:
        d.events.append(scaling.event)
    beyond = _delete_pods(d, scaling.past_end, frozenset(stale))
    if beyond:
        d.normal(
            "ScaledDown",
            f"deleted worker pods {', '.join(beyond)}",
            reports_deleted=pod_keys(beyond),
        )
        d.leaving += leaving_ips(scaling.past_end, beyond)
    return frozenset(stale + beyond)


def with_taken(
    indexes: models.WorkerIndexes,
    taken: frozenset[tuple[int, int]],
    incarnation: int,
    current: Mapping[int, ObservedPod],
) -> models.WorkerIndexes:
    """The remembered indexes, plus as disrupted each worker of this run the cluster took
    whose pod this round no longer lists (pod_watch.py)."""
    gone = {i for i, inc in taken if inc == incarnation and i not in current}
    if not gone:
        return indexes
    return indexes.model_copy(update={"disrupted": sorted(set(indexes.disrupted) | gone)})


def _workers(d: Decision, r: Round) -> WorkerRound:
    """Decide every worker index (:func:`~elasticjob_operator.workers.decide_workers`) after
    the pods that go anyway, and apply the actions: pods, events, the status's counts."""
    st, desired = d.status, r.spec.desired_replicas
    lost = lost_pods(r.pods, r.now, r.config.node_lost_grace_seconds)
    scaling = decide_scaling(st.desired_replicas, desired, r.pods)
    st.desired_replicas = desired
    going = _tidy(d, r, lost, scaling)
    current = {p.index: p for p in r.pods if p.index < desired and p.name not in going}
    indexes = with_taken(st.worker_indexes, r.observed.taken, st.incarnation, current)
    start = worker_context(
        r.ref.name, r.spec, st.incarnation, st.restart_count, indexes, current, lost
    )
    start = replace(start, departing=r.observed.departing - current.keys())
    actions, ctx = decide_workers(start, current, desired)
    created: list[str] = []
    deleted: list[str] = []
    pods: list[str] = []  # "Pod/name" of those created
    workload_ref = (
        gang.workload_ref(r.ref.name) if gang.in_use(st.placement, r.config.gang) else None
    )
    for a in actions:
        if a.act in CREATES:
            placement = r.observed.placement
            if r.first_admitted is not None and a.index >= r.first_admitted:
                placement = r.observed.more_placement  # a worker the second admission added
            pod = builders.worker_pod(
                r.ref,
                r.spec,
                a.index,
                st.incarnation,
                r.shared,
                placement,
                workload_ref,
                r.config.agent_liveness_period_seconds,
            )
            d.create.append(pod)
            created.append(builders.worker_pod_name(r.ref.name, a.index))
            pods.append(child_key(pod))
        event = a.event
        if a.act is Act.DELETE_TO_REPLACE and a.pod is not None:
            child = ChildRef("Pod", a.pod.name, force=a.force)
            d.delete.append(child)
            deleted.append(a.pod.name)
            if event is not None and not (event.reports or event.reports_deleted):
                event = replace(event, reports_deleted=(child.key,))  # said if the round stops
        if event is not None and a.act is not Act.FAIL_JOB:  # that one fails the job
            d.events.append(event)
    if created:
        replaced = any(a.act in RESTARTS for a in actions)
        d.normal(
            "ReplacedWorkers" if replaced else "CreatedWorkers",
            f"created worker pods {', '.join(created)}",
            reports=tuple(pods),
        )
    st.worker_indexes = ctx.indexes()
    st.restart_count = ctx.restart_count
    st.replica_statuses.worker.failed += sum(a.failed for a in actions)
    return WorkerRound(current, actions, ctx, going | frozenset(deleted), scaling.in_progress)


def _stuck(d: Decision, r: Round, workers: WorkerRound) -> str:
    """Rule "Stuck workers": warn about each worker the kubelet cannot start, once per
    pod and reason (:func:`decide_start_failures`); returns what the Running condition
    adds."""
    st, ctx = d.status, workers.ctx
    kept = [
        p
        for p in workers.current.values()
        if ctx.of_run(p) and not p.terminating and p.name not in workers.going
    ]
    existing = frozenset(p.name for p in r.pods if not p.foreign)
    decided = decide_start_failures(st.stuck_workers or (), kept, existing, r.now)
    st.stuck_workers = list(decided.remembered) or None
    d.events += decided.events
    return decided.summary


def _carry_on(d: Decision, r: Round, outcome: Outcome, going: frozenset[str]) -> Decision:
    """A job still running: the below-min clock, the conditions, the counts."""
    st = d.status
    st.below_min_since = outcome.below_min_since
    for c in outcome.conditions:
        set_condition(st, c.type, c.value, c.reason, c.message, r.now)
    _count(d, r.pods, going)
    st.replica_statuses.worker.active = outcome.active
    st.phase = phase_of(st)
    return d


# -- the composition -------------------------------------------------------------------


def seconds_since(then: datetime, now: datetime) -> float:
    """Elapsed seconds, compared with a spec's limit: ``then + timedelta(limit)`` overflows
    datetime for a limit the API server accepts (any int64), and failed every round."""
    return (now - then).total_seconds()


def invalid_spec(status: models.ElasticJobStatus, message: str, now: datetime) -> Decision:
    """A spec that fails the models' rules (it got past the CRD somehow): fail, loudly."""
    d = Decision(status=status.model_copy(deep=True))
    if not d.status.is_true(C.FAILED):
        _fail(d, warning("InvalidSpec", message), now)
    d.status.phase = phase_of(d.status)
    return d


def shared_etcd_of(
    ref: JobRef, spec: ElasticJobSpec, observed: Observed, config: Config
) -> SharedEtcd | None:
    """The shared etcd if this job rendezvouses there, else None: decided once per round,
    before the run's records are read from that etcd and the round is decided."""
    own = builders.etcd_name(ref.name) in observed.deployments
    return serves(spec, config.shared_etcd, runs_own_etcd=own)


def reconcile(
    ref: JobRef,
    generation: int | None,
    spec: ElasticJobSpec,
    status: models.ElasticJobStatus,
    observed: Observed,
    now: datetime,
    config: Config = Config(),
    shared: SharedEtcd | None = None,
    queue: str | None = None,
) -> Decision:
    """Everything the operator decides for one job, from what it observed; ``shared`` is
    :func:`shared_etcd_of` this round, ``queue`` the Kueue LocalQueue the job names."""
    r = Round(
        ref,
        spec,
        observed,
        tuple(sorted(observed.pods, key=lambda p: p.index)),
        now.replace(microsecond=0),
        config,
        shared.endpoint if shared is not None else None,
        queue,
    )
    d = _decide(Decision(status=status.model_copy(deep=True)), r, generation)
    if spec.provisions_etcd and not status.finished:
        mounts = any(obj.get("kind") in ("Pod", "Deployment") for obj in d.create)
        d.credentials = Credentials(recheck=mounts, shared=shared is not None)
    if d.create:  # written only if all of them are (refusals.py)
        d.status = created_status(d.status, r.now)
    d.status_first = status_first(status, d)
    return d


def status_first(before: models.ElasticJobStatus, d: Decision) -> dict[str, Any]:
    """What ``d`` writes before its children (Decision.status_first): the placement it
    decided, in the round that creates the worker pods embodying it (a pod's workloadRef
    is immutable). Written after them, it was lost with a round that stopped at a child (a
    refusal, a name still taken, a crash), and the next round, finding the job's pods,
    decided OneByOne for pods that wait for a gang; and until the round ended, the job
    showed pods and an empty status. The generation acted on goes with it, so the write
    is known for the operator's own (handlers.is_own_status_echo). Nothing once recorded."""
    pods = any(obj.get("kind") == "Pod" for obj in d.create)
    if before.placement is not None or d.status.placement is None or not pods:
        return {}
    return d.status.model_dump(
        mode="json",
        by_alias=True,
        exclude_none=True,
        include={"placement", "observed_generation"},
    )


def _decide(d: Decision, r: Round, generation: int | None) -> Decision:
    spec, st, config = r.spec, d.status, r.config
    diverged = _observe(d, r, generation)
    if st.finished:
        return _finish(d, r, frozenset())
    if diverged is not None:
        _fail(d, diverged, r.now)
        return _finish(d, r, frozenset(), stop_workers=True)
    ours = any(not p.foreign for p in r.pods)
    st.placement = gang.placement_of(st.placement, r.queue is not None, config.gang, ours)
    if spec.suspend:
        return _suspend(d, r)
    if r.queue is not None:  # rule "Queue"
        left = sum(1 for p in r.pods if not p.foreign)
        gate = decide_gate(r.queue, config.kueue, r.observed.admission, left, r.observed.priority)
        if gate.act is not QueueAct.RUN:
            return _queued(d, r, gate)
        r = _admitted(d, r, gate)
    if st.is_true(C.SUSPENDED):
        _resume(d, r)
    st.start_time = st.start_time or r.now
    deadline = spec.active_deadline_seconds
    if deadline is not None and seconds_since(st.start_time, r.now) >= deadline:
        why = f"the job ran longer than activeDeadlineSeconds={deadline}"
        _fail(d, warning("DeadlineExceeded", why), r.now)
        return _finish(d, r, frozenset(), stop_workers=True)
    _provision(d, r)
    workers = _workers(d, r)
    if workers.failure is not None:
        _fail(d, workers.failure, r.now)
        return _finish(d, r, workers.going)
    grace = config.below_min_grace_seconds
    waiting = _stuck(d, r, workers)
    outcome = decide_outcome(r.spec, workers, st.below_min_since, r.now, grace, waiting)
    if outcome.verdict is Verdict.SUCCEEDED:
        _succeed(d, outcome.message, r.now)
        return _finish(d, r, workers.going)
    if outcome.verdict is Verdict.BELOW_MIN:
        _fail(d, warning("BelowMinReplicas", outcome.message), r.now)
        return _finish(d, r, workers.going)
    return _carry_on(d, r, outcome, workers.going)
