"""The per-index worker decision on its own: one pod (or none) and the run's history in,
one action out, for every branch of the restart rules."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from elasticjob_operator.decision import Event
from elasticjob_operator.models import ElasticJobSpec, RestartPolicy, WorkerIndexes
from elasticjob_operator.observe import ObservedPod
from elasticjob_operator.workers import (
    Act,
    WorkerAction,
    WorkerContext,
    decide_worker,
    decide_workers,
    worker_context,
)


def ctx(**over: Any) -> WorkerContext:
    base: dict[str, Any] = {
        "job": "train",
        "policy": RestartPolicy.ON_FAILURE,
        "backoff_limit": 3,
        "incarnation": 0,
        "completing": False,
        "lost": frozenset(),
        "restart_count": 0,
        "launched": frozenset({0, 1, 2}),
        "replacing": frozenset(),
        "retired": frozenset(),
    }
    return WorkerContext(**{**base, **over})


def pod(index: int = 1, phase: str = "Running", **over: Any) -> ObservedPod:
    return ObservedPod(f"train-worker-{index}", index, phase, **over)


def failed(index: int = 1, code: int | None = 1, **over: Any) -> ObservedPod:
    return pod(index, "Failed", exit_code=code, **over)


@pytest.mark.parametrize(
    ("p", "context", "act"),
    [
        (pod(phase="Running"), ctx(), Act.KEEP),
        (pod(phase="Pending"), ctx(), Act.KEEP),
        (pod(phase="Succeeded"), ctx(), Act.KEEP),
        (failed(), ctx(retired=frozenset({1})), Act.KEEP),  # retired once, not again
        (failed(terminating=True), ctx(), Act.WAIT),
        (pod(terminating=True), ctx(), Act.WAIT),
        (pod(foreign=True, phase="Failed"), ctx(), Act.WAIT),
        (failed(incarnation=0), ctx(incarnation=1), Act.WAIT),
        (None, ctx(launched=frozenset()), Act.CREATE),
        (None, ctx(replacing=frozenset({1})), Act.RECREATE),
    ],
)
def test_what_needs_no_decision_about_a_failure(
    p: ObservedPod | None, context: WorkerContext, act: Act
) -> None:
    action = decide_worker(1, p, context)
    assert action == WorkerAction(act, 1)


def test_a_failed_pod_is_deleted_to_be_replaced_and_counted_as_a_failure() -> None:
    p = failed(code=2)
    assert decide_worker(1, p, ctx()) == WorkerAction(
        Act.DELETE_TO_REPLACE,
        1,
        Event(
            "Normal",
            "RestartingWorker",
            "worker train-worker-1 failed with exit code 2; deleting it to replace it",
        ),
        failed=True,
        pod=p,
    )


def test_a_vanished_pod_is_replaced_at_once() -> None:
    action = decide_worker(1, None, ctx())
    assert (action.act, action.failed) == (Act.REPLACE, True)
    assert action.event is not None
    assert action.event.message == "worker train-worker-1 was deleted; replacing it"


def test_a_pod_on_a_lost_node_is_force_deleted_though_it_looks_running() -> None:
    p = pod(phase="Running")
    action = decide_worker(1, p, ctx(lost=frozenset({p.name})))
    assert (action.act, action.force, action.pod) == (Act.DELETE_TO_REPLACE, True, p)
    assert action.event is not None
    assert "is on a node that stopped responding" in action.event.message


def test_an_eviction_without_exit_code_says_its_reason() -> None:
    action = decide_worker(1, failed(code=None, reason="Evicted"), ctx())
    assert action.event is not None and "failed (Evicted)" in action.event.message


def test_never_retires_the_index_as_a_failure() -> None:
    action = decide_worker(1, failed(), ctx(policy=RestartPolicy.NEVER))
    assert (action.act, action.failed) == (Act.RETIRE, True)
    assert action.event == Event(
        "Warning",
        "WorkerRetired",
        "worker train-worker-1 failed with exit code 1; restartPolicy Never: not replaced",
    )


@pytest.mark.parametrize(
    ("code", "act"),
    [
        (1, Act.FAIL_JOB),
        (127, Act.FAIL_JOB),
        (128, Act.DELETE_TO_REPLACE),
        (137, Act.DELETE_TO_REPLACE),
        (None, Act.DELETE_TO_REPLACE),
    ],
)
def test_exit_code_fails_the_job_on_1_to_127_only(code: int | None, act: Act) -> None:
    action = decide_worker(1, failed(code=code), ctx(policy=RestartPolicy.EXIT_CODE))
    assert action.act is act and action.failed
    if act is Act.FAIL_JOB:
        assert action.event is not None and action.event.reason == "PermanentError"


def test_the_backoff_limit_counts_restarts_and_replacements_under_way() -> None:
    context = ctx(backoff_limit=3, restart_count=2, replacing=frozenset({0}))
    action = decide_worker(1, failed(), context)
    assert action.act is Act.FAIL_JOB and action.failed
    assert action.event == Event(
        "Warning",
        "BackoffLimitExceeded",
        "worker train-worker-1 failed with exit code 1 and backoffLimit=3 replacements are spent",
    )
    always = decide_worker(1, failed(), replace(context, policy=RestartPolicy.ALWAYS))
    assert always.act is Act.DELETE_TO_REPLACE


def test_after_training_finished_nothing_is_created_or_replaced() -> None:
    done = ctx(completing=True, launched=frozenset({0}))
    not_started = decide_worker(1, None, done)
    assert not_started == WorkerAction(
        Act.RETIRE,
        1,
        Event("Normal", "WorkerNotStarted", "not starting train-worker-1: training has finished"),
    )
    left = decide_worker(1, failed(), done)
    assert (left.act, left.failed) == (Act.RETIRE, False)
    assert left.event == Event(
        "Warning",
        "WorkerLeftAfterCompletion",
        "worker train-worker-1 failed after training finished; it leaves the job",
    )
    vanished = decide_worker(0, None, done)
    assert vanished.event is not None and "train-worker-0 vanished" in vanished.event.message


def test_simultaneous_failures_share_the_budget_and_the_first_failure_of_the_job_stops() -> None:
    current = {0: failed(0), 1: failed(1), 2: failed(2)}
    actions, after = decide_workers(ctx(backoff_limit=1), current, 3)
    assert [a.act for a in actions] == [Act.DELETE_TO_REPLACE, Act.FAIL_JOB]  # 2 not decided
    assert after.replacing == {0}


def test_the_context_follows_the_actions() -> None:
    current = {1: failed(1, code=None)}
    start = ctx(launched=frozenset({0, 1}), replacing=frozenset({0}), restart_count=1)
    actions, after = decide_workers(start, current, 3)
    assert [a.act for a in actions] == [Act.RECREATE, Act.DELETE_TO_REPLACE, Act.CREATE]
    assert after.restart_count == 2  # the re-creation; the deletion counts when re-created
    assert after.indexes() == WorkerIndexes(launched=[0, 1, 2], replacing=[1], retired=[])


def test_a_round_starts_from_the_remembered_indexes_below_replicas() -> None:
    spec = ElasticJobSpec.model_validate(
        {
            "maxReplicas": 4,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "template": {"spec": {"containers": [{"name": "t", "image": "i"}]}},
                }
            },
        }
    )
    remembered = WorkerIndexes(launched=[0, 3], replacing=[2], retired=[1])
    current = {1: pod(1, "Succeeded"), 0: pod(0, foreign=True)}
    start = worker_context("train", spec, 0, 5, remembered, current, frozenset())
    assert (start.launched, start.replacing, start.retired) == ({0, 1}, set(), {1})
    assert start.completing and start.restart_count == 5
    # a pod on its way out (a scale-down, a drain) says nothing of training's end
    leaving = {1: pod(1, "Succeeded", terminating=True)}
    assert not worker_context("train", spec, 0, 5, remembered, leaving, frozenset()).completing


# -- rule "Disrupted worker": the cluster took the pod, the worker did not fail ---------


def test_an_evicted_worker_is_replaced_without_spending_the_backoff_limit() -> None:
    spent = ctx(restart_count=3, backoff_limit=3)  # one more failure would fail the job
    leaving = pod(terminating=True, disruption="EvictionByEvictionAPI")
    waited = decide_worker(1, leaving, spent)
    assert (waited.act, waited.disrupted) == (Act.WAIT, True)
    after = spent.after(waited)
    assert after.disrupted == {1} and after.indexes().disrupted == [1]
    gone = decide_worker(1, None, after)
    assert gone.act is Act.REPLACE_DISRUPTED and not gone.failed
    assert gone.event is not None and gone.event.reason == "ReplacingDisruptedWorker"
    done = after.after(gone)
    assert (done.restart_count, done.disrupted, 1 in done.launched) == (3, frozenset(), True)


def test_a_worker_the_kubelet_evicted_is_no_permanent_error_under_exit_code() -> None:
    evicted = failed(code=1, disruption="Evicted")
    action = decide_worker(1, evicted, ctx(policy=RestartPolicy.EXIT_CODE))
    assert (action.act, action.failed, action.disrupted) == (Act.DELETE_TO_REPLACE, False, True)
    assert action.event is not None and "not counted against backoffLimit" in action.event.message


def test_a_plain_delete_of_a_worker_still_counts_as_a_failure() -> None:
    """kubectl delete pod, a lost node's eviction: no DisruptionTarget reason of ours."""
    left = ctx().after(decide_worker(1, pod(terminating=True), ctx()))
    assert left.disrupted == frozenset()
    assert decide_worker(1, None, left).act is Act.REPLACE
