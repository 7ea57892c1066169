"""Rule "Queue" without a cluster: what Kueue's Workload says (as Kueue v0.17 writes it),
and what the operator decides from it round by round. The real Kueue admits, preempts
and re-admits jobs in tests/e2e/test_kueue.py."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from elasticjob_operator import builders, models
from elasticjob_operator.builders import JobRef
from elasticjob_operator.decision import ChildRef, Decision
from elasticjob_operator.kueue.admission import (
    Admission,
    State,
    admission_of,
    placement,
    reclaim_patch,
    release_patch,
)
from elasticjob_operator.kueue.gate import Act, decide_gate
from elasticjob_operator.kueue.priority import Priority, PriorityRef, priority_ref
from elasticjob_operator.kueue.workload import (
    POD_SET,
    more_workload_name,
    queue_of,
    workload,
    workload_name,
)
from elasticjob_operator.models import ConditionType as C
from elasticjob_operator.observe import Observed, ObservedPod
from elasticjob_operator.reconcile import Config, reconcile

REF = JobRef(name="train", namespace="ml", uid="uid-1")
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
QUEUE = "team-a"


def spec(replicas: int = 4, min_replicas: int = 2) -> models.ElasticJobSpec:
    return models.ElasticJobSpec.model_validate(
        {
            "minReplicas": min_replicas,
            "maxReplicas": 6,
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": "img",
                                    "resources": {"requests": {"cpu": "1"}},
                                }
                            ]
                        }
                    },
                }
            },
        }
    )


def cond(type_: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-01-01T11:00:00Z",
    }


def kueue_workload(
    count: int = 4, admitted: int | None = None, evicted: str | None = None, rv: str = "7"
) -> dict[str, Any]:
    """A Workload as Kueue leaves it: pending, admitted (``admitted`` workers on flavor
    ``on-demand``) or admitted then evicted (reason ``evicted``)."""
    obj: dict[str, Any] = {
        "metadata": {"name": workload_name("train"), "resourceVersion": rv},
        "spec": {"podSets": [{"name": POD_SET, "count": count, "minCount": 2}]},
        "status": {"conditions": []},
    }
    if admitted is None:
        obj["status"]["conditions"] = [
            cond("QuotaReserved", "False", "Pending", "couldn't assign flavors: insufficient cpu")
        ]
        return obj
    obj["status"]["admission"] = {
        "clusterQueue": "cluster-a",
        "podSetAssignments": [
            {"name": POD_SET, "count": admitted, "flavors": {"cpu": "on-demand"}}
        ],
    }
    obj["status"]["conditions"] = [
        cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-a"),
        cond("Admitted", "True", "Admitted", "The workload is admitted"),
    ]
    if evicted is not None:
        obj["status"]["conditions"].append(
            cond("Evicted", "True", evicted, "Preempted to accommodate a workload")
        )
    return obj


# -- reading the Workload --------------------------------------------------------------


def test_a_pending_workload_says_why_in_kueues_words() -> None:
    a = admission_of(kueue_workload(), POD_SET)
    assert (a.state, a.workers, a.spec_count) == (State.PENDING, 0, 4)
    assert a.message == "couldn't assign flavors: insufficient cpu"


def test_partial_admission_runs_the_admitted_count_on_the_admitted_flavor() -> None:
    a = admission_of(kueue_workload(admitted=3), POD_SET)
    assert (a.state, a.count, a.workers, a.cluster_queue, a.flavors) == (
        State.ADMITTED,
        3,
        3,
        "cluster-a",
        ("on-demand",),
    )


def test_an_evicted_workload_runs_nothing_and_names_the_reason() -> None:
    a = admission_of(kueue_workload(admitted=4, evicted="Preempted"), POD_SET)
    assert (a.state, a.workers, a.reason) == (State.EVICTED, 0, "Preempted")


def test_flavors_place_workers_by_their_node_labels_and_tolerations() -> None:
    spot = {
        "spec": {
            "nodeLabels": {"pool": "spot"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        }
    }
    got = placement([spot, {"spec": {"nodeLabels": {"zone": "a"}}}])
    assert dict(got.node_selector) == {"pool": "spot", "zone": "a"}
    pod = builders.worker_pod(REF, spec(), 0, 0, placement=got)
    assert pod["spec"]["nodeSelector"] == {"pool": "spot", "zone": "a"}
    assert {"key": "spot", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]


def test_releasing_quota_clears_the_admission_and_requeues_a_preempted_workload() -> None:
    a = admission_of(kueue_workload(admitted=4, evicted="Preempted"), POD_SET)
    patch = release_patch(a, T0)
    assert patch["metadata"] == {"resourceVersion": "7"}
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False"
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["status"] == "True"  # Kueue resets it on the next admission


def test_a_deactivated_workload_is_released_but_not_requeued() -> None:
    a = admission_of(kueue_workload(admitted=4, evicted="Deactivated"), POD_SET)
    requeued = next(
        c for c in release_patch(a, T0)["status"]["conditions"] if c["type"] == "Requeued"
    )
    assert requeued["status"] == "False"


def test_a_scale_down_gives_quota_back_and_it_is_never_taken_back() -> None:
    a = admission_of(kueue_workload(count=4, admitted=3), POD_SET)
    assert reclaim_patch(a, 3, POD_SET) is None  # 4 - 3: Kueue already counts 3
    patch = reclaim_patch(a, 2, POD_SET)
    assert patch == {"status": {"reclaimablePods": [{"name": POD_SET, "count": 2}]}}
    given_back = replace(a, reclaimable=2)
    assert given_back.workers == 2
    assert reclaim_patch(given_back, 4, POD_SET) is None  # monotonic while admitted


def test_the_workload_asks_for_the_desired_workers_and_accepts_min_replicas() -> None:
    w = workload(REF, spec(replicas=4, min_replicas=2), QUEUE, 0)
    assert w["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert w["spec"]["queueName"] == QUEUE
    (pod_set,) = w["spec"]["podSets"]
    assert (pod_set["name"], pod_set["count"], pod_set["minCount"]) == (POD_SET, 4, 2)
    containers = pod_set["template"]["spec"]["containers"]
    assert containers[0]["resources"]["requests"] == {"cpu": "1"}
    assert (
        "minCount"
        not in workload(REF, spec(replicas=2, min_replicas=2), QUEUE, 0)["spec"]["podSets"][0]
    )


def test_only_kueues_label_puts_a_job_in_a_queue() -> None:
    assert queue_of({"kueue.x-k8s.io/queue-name": QUEUE}) == QUEUE
    assert queue_of({"kueue.x-k8s.io/queue-name": ""}) is None
    assert queue_of(None) is None


def test_without_kueue_in_the_operator_a_queued_job_waits_and_says_how_to_fix_it() -> None:
    gate = decide_gate(QUEUE, False, None, 0)
    assert gate.act is Act.WAIT
    assert "kueue.enabled=true" in gate.message


# -- the rule, round by round ----------------------------------------------------------


class Cluster:
    """The job's world between rounds: worker pods and its Workloads as Kueue edits them."""

    def __init__(self, job: models.ElasticJobSpec, kueue: bool = True) -> None:
        self.spec = job
        self.status = models.ElasticJobStatus()
        self.pods: dict[str, ObservedPod] = {}
        self.workloads: dict[str, dict[str, Any]] = {}
        self.config = Config(kueue=kueue)
        self.last = Decision()

    @property
    def workload(self) -> dict[str, Any] | None:
        return self.workloads.get(workload_name("train"))

    def round(self) -> Decision:
        def seen(name: str) -> Admission | None:
            w = self.workloads.get(name)
            return admission_of(w, POD_SET) if w is not None else None

        observed = Observed(
            pods=tuple(self.pods.values()),
            admission=seen(workload_name("train")),
            more=seen(more_workload_name("train")),
        )
        d = reconcile(REF, 1, self.spec, self.status, observed, T0, self.config, queue=QUEUE)
        for ref in d.delete:
            if ref.kind == "Pod" and ref.name in self.pods:
                self.pods[ref.name] = replace(self.pods[ref.name], terminating=True)
            if ref.kind == "Workload":
                self.workloads.pop(ref.name, None)
        for obj in d.create:
            if obj["kind"] == "Pod":
                labels = obj["metadata"]["labels"]
                self.pods[obj["metadata"]["name"]] = ObservedPod(
                    name=obj["metadata"]["name"],
                    index=int(labels[builders.LABEL_INDEX]),
                    phase="Running",
                    incarnation=int(labels[builders.LABEL_INCARNATION]),
                )
            elif obj["kind"] == "Workload":
                name = obj["metadata"]["name"]
                w = kueue_workload(count=obj["spec"]["podSets"][0]["count"])
                w["metadata"]["name"] = name
                self.workloads[name] = w
        for name, patch in d.workload_status.items():
            if name in self.workloads:
                self.workloads[name]["status"].update(patch["status"])
        self.status, self.last = d.status, d
        return d

    def kueue_admits(self, count: int, name: str = workload_name("train")) -> None:
        w = self.workloads[name]
        self.workloads[name] = kueue_workload(
            count=w["spec"]["podSets"][0]["count"], admitted=count
        )
        self.workloads[name]["metadata"]["name"] = name

    def kueue_evicts(self, reason: str, name: str = workload_name("train")) -> None:
        w = self.workloads[name]
        admitted = w["status"]["admission"]["podSetAssignments"][0]["count"]
        count = w["spec"]["podSets"][0]["count"]
        self.workloads[name] = kueue_workload(count=count, admitted=admitted, evicted=reason)
        self.workloads[name]["metadata"]["name"] = name

    def pods_gone(self) -> None:
        self.pods = {n: p for n, p in self.pods.items() if not p.terminating}


def kinds(d: Decision) -> list[str]:
    return [o["kind"] for o in d.create]


def test_a_queued_job_creates_its_workload_and_nothing_else_until_admitted() -> None:
    c = Cluster(spec(replicas=4))
    d = c.round()
    assert kinds(d) == ["Workload"]
    assert c.status.phase == "Queued" and c.status.is_true(C.QUEUED)
    assert [e.reason for e in d.events] == ["Created", "Queued"]
    d = c.round()  # still pending: nothing new, nothing said again
    assert d.create == [] and d.events == []
    assert (
        "insufficient cpu"
        in (c.status.condition(C.QUEUED) or models.Condition(type=C.QUEUED, status="True")).message
    )


def test_a_partially_admitted_job_runs_the_admitted_workers_and_says_so() -> None:
    c = Cluster(spec(replicas=4, min_replicas=2))
    c.round()
    c.kueue_admits(3)
    d = c.round()
    assert sorted(c.pods) == ["train-worker-0", "train-worker-1", "train-worker-2"]
    assert "Admitted" in [e.reason for e in d.events]
    assert c.status.admitted_replicas == 3
    assert c.status.is_true(C.ADMITTED) and not c.status.is_true(C.QUEUED)
    assert (
        "3 of 4 workers"
        in (
            c.status.condition(C.ADMITTED) or models.Condition(type=C.ADMITTED, status="True")
        ).message
    )
    c.round()
    assert c.status.phase == "Running"


def test_an_evicted_job_stops_gives_quota_back_and_resumes_as_a_new_run() -> None:
    c = Cluster(spec(replicas=2, min_replicas=2))
    c.round()
    c.kueue_admits(2)
    c.round()
    c.kueue_evicts("Preempted")
    d = c.round()
    assert sorted(r.name for r in d.delete if r.kind == "Pod") == [
        "train-worker-0",
        "train-worker-1",
    ]
    assert d.workload_status == {}  # not before the workers are gone
    assert c.status.phase == "Queued" and c.status.is_true(C.SUSPENDED)
    c.pods_gone()
    d = c.round()
    assert d.workload_status[workload_name("train")]["status"]["admission"] is None
    c.kueue_admits(2)
    d = c.round()
    assert "Resumed" in [e.reason for e in d.events]
    assert c.status.incarnation == 1
    assert c.status.restart_count == 0 and c.status.replica_statuses.worker.failed == 0
    assert sorted(c.pods) == ["train-worker-0", "train-worker-1"]


def test_a_finished_job_deletes_its_workload_so_the_quota_goes_back() -> None:
    c = Cluster(spec(replicas=2, min_replicas=2))
    c.round()
    c.kueue_admits(2)
    c.round()
    for name in c.pods:
        c.pods[name] = replace(c.pods[name], phase="Succeeded", exit_code=0)
    d = c.round()
    assert c.status.phase == "Succeeded"
    assert ChildRef("Workload", workload_name("train")) in d.delete


def test_suspending_a_queued_job_gives_its_quota_back() -> None:
    c = Cluster(spec(replicas=2, min_replicas=2))
    c.round()
    c.kueue_admits(2)
    c.round()
    c.spec = c.spec.model_copy(update={"suspend": True})
    d = c.round()
    assert ChildRef("Workload", workload_name("train")) in d.delete


def test_an_admission_is_read_back_as_admission_of_says() -> None:
    a: Admission = admission_of(kueue_workload(admitted=2), POD_SET)
    assert decide_gate(QUEUE, True, a, 0).workers == 2


def test_kueues_priority_label_comes_before_the_pod_priority_class() -> None:
    job = spec()
    template = job.worker.template.spec.model_dump(by_alias=True)
    with_class = models.ElasticJobSpec.model_validate(
        {
            **job.model_dump(by_alias=True, exclude_none=True),
            "replicaSpecs": {
                "Worker": {
                    "replicas": 4,
                    "template": {"spec": {**template, "priorityClassName": "batch"}},
                }
            },
        }
    )
    assert priority_ref(None, with_class) == PriorityRef(
        "scheduling.k8s.io", "PriorityClass", "batch"
    )
    label = {"kueue.x-k8s.io/priority-class": "urgent"}
    ref = priority_ref(label, with_class)
    assert ref == PriorityRef("kueue.x-k8s.io", "WorkloadPriorityClass", "urgent")
    assert priority_ref(None, job) is None
    w = workload(REF, job, QUEUE, 0, Priority(ref, 1000))
    assert w["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "urgent",
    }
    assert w["spec"]["priority"] == 1000


def test_a_job_naming_a_missing_priority_class_waits_and_names_it() -> None:
    missing = Priority(PriorityRef("kueue.x-k8s.io", "WorkloadPriorityClass", "urgnet"), None)
    gate = decide_gate(QUEUE, True, None, 0, missing)
    assert gate.act is Act.WAIT
    assert "WorkloadPriorityClass 'urgnet', which does not exist" in gate.message


def test_a_job_readmitted_with_fewer_workers_succeeds_when_those_finish() -> None:
    c = Cluster(spec(replicas=3, min_replicas=1))
    c.round()
    c.kueue_admits(3)
    c.round()
    c.kueue_evicts("Preempted")
    c.round()
    c.pods_gone()
    c.round()
    c.kueue_admits(1)  # what is left of the quota after the preemptor's share
    c.round()
    assert sorted(c.pods) == ["train-worker-0"]
    c.pods["train-worker-0"] = replace(c.pods["train-worker-0"], phase="Running")
    c.round()
    running = c.status.condition(C.RUNNING)
    assert running is not None and running.message.startswith("1 of 1 workers running")
    c.pods["train-worker-0"] = replace(c.pods["train-worker-0"], phase="Succeeded", exit_code=0)
    c.round()
    assert c.status.phase == "Succeeded"


def test_workers_a_partial_admission_left_out_are_asked_for_and_join_when_admitted() -> None:
    c = Cluster(spec(replicas=4, min_replicas=2))
    c.round()
    c.kueue_admits(3)
    d = c.round()
    (more,) = [o for o in d.create if o["kind"] == "Workload"]
    assert more["metadata"]["name"] == more_workload_name("train")
    assert more["spec"]["podSets"][0]["count"] == 1 and "minCount" not in more["spec"]["podSets"][0]
    assert sorted(c.pods) == [f"train-worker-{i}" for i in range(3)]
    admitted = c.status.condition(C.ADMITTED)
    assert admitted is not None and "asking Kueue for 1 more" in admitted.message
    c.round()
    assert [o for o in c.last.create if o["kind"] == "Workload"] == []  # asked once
    c.kueue_admits(1, more_workload_name("train"))  # quota freed
    d = c.round()
    assert [o["metadata"]["name"] for o in d.create if o["kind"] == "Pod"] == ["train-worker-3"]
    assert c.status.admitted_replicas == 4 and "Admitted" in [e.reason for e in d.events]


def test_an_evicted_second_admission_shrinks_the_job_to_its_first_and_asks_again() -> None:
    c = Cluster(spec(replicas=4, min_replicas=2))
    c.round()
    c.kueue_admits(3)
    c.round()
    c.kueue_admits(1, more_workload_name("train"))
    c.round()
    c.kueue_evicts("Preempted", more_workload_name("train"))
    d = c.round()
    assert [r.name for r in d.delete if r.kind == "Pod"] == ["train-worker-3"]
    assert more_workload_name("train") in c.workloads  # held until its worker is gone
    assert not c.status.is_true(C.SUSPENDED)  # the job goes on at 3
    c.pods_gone()
    d = c.round()
    assert ChildRef("Workload", more_workload_name("train")) in d.delete
    d = c.round()  # and it asks again for the one it lacks
    asked = [o["metadata"]["name"] for o in d.create if o["kind"] == "Workload"]
    assert asked == [more_workload_name("train")]


def test_scaling_down_to_the_first_admission_drops_the_second_request() -> None:
    c = Cluster(spec(replicas=4, min_replicas=2))
    c.round()
    c.kueue_admits(3)
    c.round()
    c.spec = spec(replicas=3, min_replicas=2)
    d = c.round()
    assert ChildRef("Workload", more_workload_name("train")) in d.delete
