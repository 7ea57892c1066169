"""A worker pod the cluster took and that was gone before a round listed it: its DELETED
event's last state makes it disrupted (replaced, not charged to backoffLimit)."""

from __future__ import annotations

from elasticjob_operator import builders
from elasticjob_operator.models import WorkerIndexes
from elasticjob_operator.observe import ObservedPod
from elasticjob_operator.reconcile import with_taken
from elasticjob_operator.taken_pods import TakenPods, taken_index


def deleted_pod(reason: str | None, index: str = "1") -> dict[str, object]:
    conditions = (
        [] if reason is None else [{"type": "DisruptionTarget", "status": "True", "reason": reason}]
    )
    labels = {builders.LABEL_INDEX: index, builders.LABEL_INCARNATION: "2"}
    return {"metadata": {"labels": labels}, "status": {"conditions": conditions}}


def test_a_deleted_pod_the_cluster_took_is_noted_by_index_and_run() -> None:
    assert taken_index(deleted_pod("EvictionByEvictionAPI")) == (1, 2)
    assert taken_index(deleted_pod(None)) is None  # a plain delete is a failure
    assert taken_index(deleted_pod("DeletionByTaintManager")) is None  # a lost node too
    assert taken_index(deleted_pod("PreemptionByScheduler", index="x")) is None


def test_a_round_takes_the_notes_of_its_job_once() -> None:
    taken = TakenPods()
    taken.note("ns", "job", (1, 2))
    taken.note("ns", "other", (0, 0))
    assert taken.take("ns", "job") == {(1, 2)}
    assert taken.take("ns", "job") == frozenset()
    assert taken.take("ns", "other") == {(0, 0)}


def test_only_this_runs_workers_whose_pod_is_gone_count_as_disrupted() -> None:
    remembered = WorkerIndexes(launched=[0, 1, 2], disrupted=[3])
    present = {0: ObservedPod(name="w-0", index=0, phase="Running", incarnation=2)}
    out = with_taken(remembered, frozenset({(1, 2), (0, 2), (2, 1)}), 2, present)
    assert out.disrupted == [1, 3]  # 0 has a pod again; 2 was an earlier run's
    assert with_taken(remembered, frozenset(), 2, present) is remembered
