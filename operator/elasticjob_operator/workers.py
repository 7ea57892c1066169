"""What to do about each worker index this round: one pure decision per index.

:func:`decide_worker` looks at one index and its pod (if any) and returns a
:class:`WorkerAction`: keep it, wait for an old pod to go, create, re-create, replace,
delete to replace, retire, or fail the job, with the event that says why.
:func:`decide_workers` runs it over the indexes in order, carrying what each action changes
(the restart budget, the index lists kept in ``status.workerIndexes``), and stops at the
first action that fails the job. The rules are in docs/operator.md ("The rules").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

from elasticjob_operator import builders
from elasticjob_operator.decision import Event, normal, warning
from elasticjob_operator.models import ElasticJobSpec, RestartPolicy, WorkerIndexes
from elasticjob_operator.observe import ObservedPod


class Act(StrEnum):
    KEEP = "keep"  # pending, running or succeeded; or an index already retired
    # an older pod (terminating, foreign, an earlier run's, departing) holds the name
    WAIT = "wait"
    CREATE = "create"  # never launched in this run
    RECREATE = "recreate"  # the pod deleted to be replaced is gone: create its successor
    REPLACE = "replace"  # a pod this run launched vanished: create it again at once
    # a pod the cluster took (preempted, evicted) is gone: create it again, uncounted
    REPLACE_DISRUPTED = "replace-disrupted"
    DELETE_TO_REPLACE = "delete-to-replace"  # it failed: delete it, re-create once gone
    RETIRE = "retire"  # it leaves the job (restartPolicy Never, or training has finished)
    FAIL_JOB = "fail-job"  # a permanent error, or the backoff limit is spent


CREATES: Final = frozenset({Act.CREATE, Act.RECREATE, Act.REPLACE, Act.REPLACE_DISRUPTED})
RESTARTS: Final = frozenset({Act.RECREATE, Act.REPLACE})  # counted in status.restartCount


@dataclass(frozen=True)
class WorkerAction:
    act: Act
    index: int
    event: Event | None = None  # for FAIL_JOB, the failure's reason and message
    failed: bool = False  # a worker failure (status.replicaStatuses.Worker.failed)
    pod: ObservedPod | None = None  # DELETE_TO_REPLACE: the pod to delete
    force: bool = False  # delete with grace 0: its node stopped responding
    disrupted: bool = False  # the cluster took its pod: remembered, replaced uncounted


@dataclass(frozen=True)
class WorkerContext:
    """What the decisions about the indexes share: the job's settings, this run's history
    (launched / being replaced / retired indexes) and the restarts counted so far."""

    job: str
    policy: RestartPolicy
    backoff_limit: int
    incarnation: int
    completing: bool  # a worker of this run exited 0: training has finished
    lost: frozenset[str]  # pods on a node that stopped responding, past the grace
    restart_count: int
    launched: frozenset[int]
    replacing: frozenset[int]
    retired: frozenset[int]
    disrupted: frozenset[int] = frozenset()
    # gone from the listing, its DELETED event (its last state) not yet come (pod_watch.py)
    departing: frozenset[int] = frozenset()

    def of_run(self, pod: ObservedPod) -> bool:
        """The pod is ours and belongs to the current run."""
        return not pod.foreign and pod.incarnation == self.incarnation

    def after(self, action: WorkerAction) -> WorkerContext:
        """The context once ``action`` is taken."""
        i = frozenset({action.index})
        if action.disrupted:
            return replace(self, disrupted=self.disrupted | i)
        if action.act is Act.REPLACE_DISRUPTED:
            return replace(self, launched=self.launched | i, disrupted=self.disrupted - i)
        if action.act is Act.CREATE:
            return replace(self, launched=self.launched | i)
        if action.act is Act.RECREATE:
            return replace(
                self,
                launched=self.launched | i,
                replacing=self.replacing - i,
                restart_count=self.restart_count + 1,
            )
        if action.act is Act.REPLACE:
            return replace(self, launched=self.launched | i, restart_count=self.restart_count + 1)
        if action.act is Act.DELETE_TO_REPLACE:
            return replace(self, replacing=self.replacing | i)
        if action.act is Act.RETIRE:
            return replace(self, retired=self.retired | i)
        return self

    def indexes(self) -> WorkerIndexes:
        """As kept in ``status.workerIndexes``."""
        return WorkerIndexes(
            launched=sorted(self.launched),
            replacing=sorted(self.replacing),
            retired=sorted(self.retired),
            disrupted=sorted(self.disrupted),
        )


def worker_context(
    job: str,
    spec: ElasticJobSpec,
    incarnation: int,
    restart_count: int,
    indexes: WorkerIndexes,
    current: Mapping[int, ObservedPod],
    lost: frozenset[str],
) -> WorkerContext:
    """The context at the start of a round: the remembered indexes below ``replicas``, and
    every index whose pod of this run is there counts as launched."""
    desired = spec.desired_replicas

    def below(values: list[int]) -> frozenset[int]:
        return frozenset(i for i in values if i < desired)

    ctx = WorkerContext(
        job=job,
        policy=spec.worker.restart_policy,
        backoff_limit=spec.backoff_limit,
        incarnation=incarnation,
        completing=False,
        lost=lost,
        restart_count=restart_count,
        launched=below(indexes.launched),
        replacing=below(indexes.replacing),
        retired=below(indexes.retired),
        disrupted=below(indexes.disrupted),
    )
    mine = [p for p in current.values() if ctx.of_run(p)]
    return replace(
        ctx,
        # a pod on its way out (scale-down, drain) exited as it was told: not an end
        completing=any(p.phase == "Succeeded" and not p.terminating for p in mine),
        launched=ctx.launched | {p.index for p in mine},
    )


def decide_workers(
    ctx: WorkerContext, current: Mapping[int, ObservedPod], desired: int
) -> tuple[tuple[WorkerAction, ...], WorkerContext]:
    """Every index below ``desired``, in order; stops at the first FAIL_JOB. Returns the
    actions and the context after them."""
    actions = []
    for index in range(desired):
        action = decide_worker(index, current.get(index), ctx)
        actions.append(action)
        if action.act is Act.FAIL_JOB:
            break
        ctx = ctx.after(action)
    return tuple(actions), ctx


def decide_worker(index: int, pod: ObservedPod | None, ctx: WorkerContext) -> WorkerAction:
    """One index, given its pod (None: there is none). Rules "Failed or vanished worker",
    "Worker on a lost node" and "Success"."""
    if index in ctx.retired:
        return WorkerAction(Act.KEEP, index)
    if pod is None and index in ctx.departing:  # its last state is on its way
        return WorkerAction(Act.WAIT, index)
    if pod is not None and (pod.terminating or not ctx.of_run(pod)):
        # the name is stable: the old pod goes first
        return WorkerAction(Act.WAIT, index, disrupted=_disrupted(pod, ctx))
    on_lost_node = pod is not None and pod.name in ctx.lost
    if pod is not None and pod.phase != "Failed" and not on_lost_node:
        return WorkerAction(Act.KEEP, index)
    if ctx.completing:
        return _leave_after_completion(index, pod, ctx)
    if pod is None and index in ctx.disrupted:
        name = builders.worker_pod_name(ctx.job, index)
        message = f"worker {name} was taken by the cluster; replacing it (not a failure)"
        return WorkerAction(
            Act.REPLACE_DISRUPTED, index, normal("ReplacingDisruptedWorker", message)
        )
    if pod is not None and pod.disruption and ctx.of_run(pod):  # evicted by the kubelet
        name = builders.worker_pod_name(ctx.job, index)
        message = (
            f"worker {name} was taken by the cluster ({pod.disruption}); deleting it to "
            "replace it (not counted against backoffLimit)"
        )
        event = normal("DisruptedWorker", message)
        return WorkerAction(Act.DELETE_TO_REPLACE, index, event, pod=pod, disrupted=True)
    if pod is None and index in ctx.replacing:
        return WorkerAction(Act.RECREATE, index)
    if pod is None and index not in ctx.launched:
        return WorkerAction(Act.CREATE, index)
    return decide_failure(index, pod, on_lost_node, ctx)


def _disrupted(pod: ObservedPod, ctx: WorkerContext) -> bool:
    """A terminating pod of this run that the cluster is taking (preemption, eviction)."""
    return bool(pod.disruption) and pod.terminating and ctx.of_run(pod)


def _leave_after_completion(
    index: int, pod: ObservedPod | None, ctx: WorkerContext
) -> WorkerAction:
    """Training has finished: nothing is created or replaced any more."""
    name = builders.worker_pod_name(ctx.job, index)
    if pod is None and index not in ctx.launched and index not in ctx.replacing:
        event = normal("WorkerNotStarted", f"not starting {name}: training has finished")
    else:
        what = "failed" if pod is not None else "vanished"
        event = warning(
            "WorkerLeftAfterCompletion",
            f"worker {name} {what} after training finished; it leaves the job",
        )
    return WorkerAction(Act.RETIRE, index, event)


def decide_failure(
    index: int, pod: ObservedPod | None, on_lost_node: bool, ctx: WorkerContext
) -> WorkerAction:
    """A failed worker (its pod failed or is on a lost node; None: a pod this run launched
    vanished), handled by restartPolicy and backoffLimit."""
    name = builders.worker_pod_name(ctx.job, index)
    code = pod.exit_code if pod is not None else None
    if pod is None:
        why = "was deleted"
    elif on_lost_node:
        why = "is on a node that stopped responding"
    elif code is not None:
        why = f"failed with exit code {code}"
    else:
        why = f"failed ({pod.reason or 'no exit code'})"
    if ctx.policy is RestartPolicy.NEVER:
        message = f"worker {name} {why}; restartPolicy Never: not replaced"
        return WorkerAction(Act.RETIRE, index, warning("WorkerRetired", message), failed=True)
    if ctx.policy is RestartPolicy.EXIT_CODE and code is not None and 1 <= code <= 127:
        message = (
            f"worker {name} {why}: a permanent error under restartPolicy ExitCode "
            "(1-127; 128 and above would be retried)"
        )
        return WorkerAction(Act.FAIL_JOB, index, warning("PermanentError", message), failed=True)
    limit = ctx.backoff_limit
    if ctx.policy is not RestartPolicy.ALWAYS and ctx.restart_count + len(ctx.replacing) >= limit:
        message = f"worker {name} {why} and backoffLimit={limit} replacements are spent"
        event = warning("BackoffLimitExceeded", message)
        return WorkerAction(Act.FAIL_JOB, index, event, failed=True)
    if pod is None:
        event = normal("RestartingWorker", f"worker {name} {why}; replacing it")
        return WorkerAction(Act.REPLACE, index, event, failed=True)
    event = normal("RestartingWorker", f"worker {name} {why}; deleting it to replace it")
    return WorkerAction(
        Act.DELETE_TO_REPLACE, index, event, failed=True, pod=pod, force=on_lost_node
    )
