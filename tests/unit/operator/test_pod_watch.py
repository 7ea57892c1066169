"""What the pod watch tells a round that its listing cannot: a worker the cluster took and
that was gone before a round listed it (replaced, not charged to backoffLimit), and a
worker whose pod is gone before its DELETED event came (decided only once it comes)."""

from __future__ import annotations

from dataclasses import replace

from elasticjob_operator import builders
from elasticjob_operator.models import ElasticJobSpec, WorkerIndexes
from elasticjob_operator.observe import ObservedPod, worker_labels
from elasticjob_operator.pod_watch import (
    DEPARTING_LIMIT_S,
    GONE_KEEP_S,
    PodWatch,
    WatchNews,
    taken_index,
)
from elasticjob_operator.reconcile import with_taken
from elasticjob_operator.workers import Act, decide_workers, worker_context

JOB = ("ns", "job")


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
    assert worker_labels(deleted_pod(None, index="3")) == (3, 2)
    assert worker_labels({"metadata": {}}) is None


NONE: dict[str, int] = {}


def test_a_round_takes_the_notes_of_its_job_once() -> None:
    watch = PodWatch()
    watch.deleted(JOB, "uid-1", (1, 2), 0.0)
    watch.deleted(("ns", "other"), "uid-o", (0, 0), 0.0)
    watch.deleted(JOB, "uid-0", None, 0.0)  # a plain delete: nothing to note
    assert watch.settle(JOB, NONE, 0.0) == WatchNews(taken=frozenset({(1, 2)}))
    assert watch.settle(JOB, NONE, 0.0) == WatchNews()
    assert watch.settle(("ns", "other"), NONE, 0.0).taken == {(0, 0)}


def test_a_pod_gone_from_the_listing_departs_until_its_deleted_event_comes() -> None:
    watch = PodWatch()
    watch.saw(JOB, "uid-0", 0)
    watch.saw(JOB, "uid-1", 1)
    both = {"uid-0": 0, "uid-1": 1}
    assert watch.settle(JOB, both, 0.0) == WatchNews()
    # the listing already lacks worker 1; the watch has not delivered its DELETED event
    assert watch.settle(JOB, {"uid-0": 0}, 1.0).departing == {1}
    assert watch.settle(JOB, {"uid-0": 0}, 2.0).departing == {1}
    watch.deleted(JOB, "uid-1", (1, 0), 2.5)  # its last state: the cluster took it
    news = watch.settle(JOB, {"uid-0": 0}, 3.0)
    assert news == WatchNews(taken=frozenset({(1, 0)}))  # taken in the same read


def test_a_pod_only_a_listing_saw_departs_too() -> None:
    """The watch ran behind: a pod was created, listed and evicted before its ADDED event
    was handled. The listing alone holds it alive (CI once failed a drained
    backoffLimit 0 job so, 0.4 s after it started)."""
    watch = PodWatch()
    assert watch.settle(JOB, {"uid-0": 0, "uid-1": 1}, 0.0) == WatchNews()
    assert watch.settle(JOB, {"uid-1": 1}, 0.4).departing == {0}
    watch.saw(JOB, "uid-0", 0)  # the lagging ADDED event, then its DELETED one
    watch.deleted(JOB, "uid-0", (0, 0), 0.6)
    assert watch.settle(JOB, {"uid-1": 1}, 0.7) == WatchNews(taken=frozenset({(0, 0)}))


def test_a_listing_read_before_a_deleted_event_does_not_revive_the_pod() -> None:
    watch = PodWatch()
    watch.saw(JOB, "uid-0", 0)
    watch.deleted(JOB, "uid-0", None, 1.0)
    assert watch.settle(JOB, {"uid-0": 0}, 1.1) == WatchNews()  # read before the delete
    assert watch.settle(JOB, NONE, 2.0) == WatchNews()  # not departing: it is gone
    watch.saw(JOB, "uid-0", 0)  # a MODIFIED event handled after its DELETED one
    assert watch.settle(JOB, NONE, 3.0) == WatchNews()
    # long after, the note is forgotten (a uid never comes back)
    watch.deleted(JOB, "uid-9", None, 1.0 + GONE_KEEP_S)
    assert watch.settle(JOB, {"uid-0": 0}, 2.0 + GONE_KEEP_S) == WatchNews()
    assert watch.settle(JOB, NONE, 3.0 + GONE_KEEP_S).departing == {0}


def test_a_replacement_of_the_same_name_is_a_pod_of_its_own() -> None:
    """Handlers of the old pod's DELETED and the new pod's ADDED may run in either order;
    by uid, neither undoes the other."""
    watch = PodWatch()
    watch.saw(JOB, "uid-new", 0)
    watch.deleted(JOB, "uid-old", (0, 0), 1.0)
    assert watch.settle(JOB, {"uid-new": 0}, 1.5) == WatchNews(taken=frozenset({(0, 0)}))
    assert watch.settle(JOB, NONE, 2.0).departing == {0}  # the new one is held alive


def test_a_departure_whose_deleted_event_never_comes_ends_at_the_limit() -> None:
    watch = PodWatch()
    watch.saw(JOB, "uid-0", 0)
    assert watch.settle(JOB, NONE, 5.0).departing == {0}
    assert watch.settle(JOB, NONE, 5.0 + DEPARTING_LIMIT_S - 0.1).departing == {0}
    assert watch.settle(JOB, NONE, 5.0 + DEPARTING_LIMIT_S).departing == frozenset()
    assert watch.settle(JOB, NONE, 100.0) == WatchNews()  # forgotten for good


def test_a_pod_listed_again_is_no_longer_departing() -> None:
    watch = PodWatch()
    watch.saw(JOB, "uid-0", 0)
    assert watch.settle(JOB, NONE, 0.0).departing == {0}
    listed = {"uid-0": 0}  # the listing and the watch disagreed for a moment
    assert watch.settle(JOB, listed, 1.0) == WatchNews()
    assert watch.settle(JOB, NONE, 50.0).departing == {0}  # its clock starts again


def test_a_departing_worker_waits_where_a_vanished_one_would_spend_the_backoff_limit() -> None:
    template = {"spec": {"containers": [{"name": "t", "image": "i"}]}}
    spec = ElasticJobSpec.model_validate(
        {"backoffLimit": 0, "replicaSpecs": {"Worker": {"replicas": 2, "template": template}}}
    )
    running = {0: ObservedPod(name="train-worker-0", index=0, phase="Running")}
    start = worker_context(
        "train", spec, 0, 0, WorkerIndexes(launched=[0, 1]), running, frozenset()
    )
    vanished, _ = decide_workers(start, running, 2)
    assert vanished[1].act is Act.FAIL_JOB  # what the CI run saw: a drain failed the job
    departing, _ = decide_workers(replace(start, departing=frozenset({1})), running, 2)
    assert [a.act for a in departing] == [Act.KEEP, Act.WAIT]


def test_only_this_runs_workers_whose_pod_is_gone_count_as_disrupted() -> None:
    remembered = WorkerIndexes(launched=[0, 1, 2], disrupted=[3])
    present = {0: ObservedPod(name="w-0", index=0, phase="Running", incarnation=2)}
    out = with_taken(remembered, frozenset({(1, 2), (0, 2), (2, 1)}), 2, present)
    assert out.disrupted == [1, 3]  # 0 has a pod again; 2 was an earlier run's
    assert with_taken(remembered, frozenset(), 2, present) is remembered


def test_a_deleted_job_is_forgotten() -> None:
    watch = PodWatch()
    watch.saw(JOB, "uid-0", 0)  # its DELETED event will never come
    watch.forget(JOB)
    assert watch.settle(JOB, NONE, 0.0) == WatchNews()  # not departing: nothing held
