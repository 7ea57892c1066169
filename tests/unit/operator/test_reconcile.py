"""The operator's decisions, rule by rule, without a cluster.

A tiny in-memory world plays the cluster's part between rounds: what the decision
creates appears (pods Pending), what it deletes disappears, and a test moves pods to
Running/Failed/Succeeded the way a kubelet would. Each test asserts what a user would
see: pod names, status fields, conditions, events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_operator import builders, models
from elasticjob_operator.builders import JobRef
from elasticjob_operator.conditions import set_condition
from elasticjob_operator.decision import ChildRef, Decision, reported
from elasticjob_operator.models import ConditionType as C
from elasticjob_operator.node_memory import suggested_shm_size
from elasticjob_operator.observe import (
    Observed,
    ObservedPod,
    Waiting,
    exit_code,
    ledger_of,
    memory_fallbacks_of,
    observe_pod,
    progress_of,
)
from elasticjob_operator.reconcile import (
    Config,
    Verdict,
    WorkerRound,
    decide_finish,
    decide_outcome,
    decide_scaling,
    invalid_spec,
    reconcile,
)
from elasticjob_operator.workers import worker_context
from elasticjob_runtime.etcd.records import (
    Divergence,
    Hang,
    MemoryFallback,
    Progress,
    encode_progress,
)
from elasticjob_runtime.goodput import ledger as gl
from elasticjob_runtime.goodput.ledger import Ledger

REF = JobRef(name="train", namespace="ml", uid="uid-1")
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def make_spec(**over: Any) -> models.ElasticJobSpec:
    worker: dict[str, Any] = {
        "replicas": over.pop("replicas", 2),
        "restartPolicy": over.pop("restartPolicy", "OnFailure"),
        "template": {"spec": {"containers": [{"name": "trainer", "image": "img"}]}},
    }
    raw: dict[str, Any] = {"minReplicas": 1, "maxReplicas": 4, "replicaSpecs": {"Worker": worker}}
    raw.update(over)
    return models.ElasticJobSpec.model_validate(raw)


@dataclass
class World:
    """The cluster between rounds: pods by name, Services, Deployments."""

    spec: models.ElasticJobSpec
    status: models.ElasticJobStatus = field(default_factory=models.ElasticJobStatus)
    pods: dict[str, ObservedPod] = field(default_factory=dict)
    services: set[str] = field(default_factory=set)
    deployments: set[str] = field(default_factory=set)
    now: datetime = T0
    config: Config = field(default_factory=lambda: Config(below_min_grace_seconds=60))
    last: Decision | None = None

    def observed(
        self, progress: models.Progress | None = None, ledger: Ledger | None = None
    ) -> Observed:
        return Observed(
            pods=tuple(self.pods.values()),
            services=frozenset(self.services),
            deployments=frozenset(self.deployments),
            progress=progress,
            ledger=ledger,
        )

    def round(
        self, progress: models.Progress | None = None, ledger: Ledger | None = None
    ) -> Decision:
        observed = self.observed(progress, ledger)
        d = reconcile(REF, 1, self.spec, self.status, observed, self.now, self.config)
        for ref in d.delete:
            if ref.kind == "Pod" and ref.name in self.pods:
                # deletion is graceful: the pod is terminating until `settle`
                self.pods[ref.name] = replace(self.pods[ref.name], terminating=True)
            elif ref.kind == "Service":
                self.services.discard(ref.name)
            elif ref.kind == "Deployment":
                self.deployments.discard(ref.name)
        for obj in d.create:
            name = obj["metadata"]["name"]
            kind = obj["kind"]
            if kind == "Pod":
                labels = obj["metadata"]["labels"]
                self.pods[name] = ObservedPod(
                    name=name,
                    index=int(labels[builders.LABEL_INDEX]),
                    phase="Pending",
                    incarnation=int(labels[builders.LABEL_INCARNATION]),
                )
            elif kind == "Service":
                self.services.add(name)
            else:
                self.deployments.add(name)
        self.status = d.status
        self.last = d
        return d

    def settle(self) -> None:
        """Terminating pods finish going away."""
        self.pods = {n: p for n, p in self.pods.items() if not p.terminating}

    def set(self, i: int, phase: str, code: int | None = None, reason: str = "") -> None:
        name = builders.worker_pod_name(REF.name, i)
        self.pods[name] = replace(self.pods[name], phase=phase, exit_code=code, reason=reason)

    def run_all(self) -> None:
        for i in list(self.indexes()):
            self.set(i, "Running")

    def indexes(self) -> list[int]:
        return sorted(p.index for p in self.pods.values())

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def reasons(d: Decision) -> list[str]:
    return [e.reason for e in d.events]


def pod_names(d: Decision) -> list[str]:
    return [o["metadata"]["name"] for o in d.create if o["kind"] == "Pod"]


def deleted_pods(d: Decision) -> list[str]:
    return [r.name for r in d.delete if r.kind == "Pod"]


def cond(status: models.ElasticJobStatus, type_: C) -> models.Condition:
    c = status.condition(type_)
    assert c is not None, f"no {type_} condition in {status.conditions}"
    return c


def running_world(**over: Any) -> World:
    w = World(make_spec(**over))
    w.round()
    w.run_all()
    w.round()
    return w


# -- creation and steady state ---------------------------------------------------------


def test_first_round_creates_service_etcd_and_stably_named_workers() -> None:
    w = World(make_spec(replicas=3))
    d = w.round()
    assert pod_names(d) == ["train-worker-0", "train-worker-1", "train-worker-2"]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in d.create if o["kind"] != "Pod")
    assert kinds == [
        ("Deployment", "train-etcd"),
        ("Service", "train-etcd"),
        ("Service", "train-worker"),
    ]
    assert d.status.is_true(C.CREATED)
    assert d.status.phase == "Created"
    assert d.status.start_time == T0
    assert d.status.worker_indexes.launched == [0, 1, 2]
    assert d.status.replica_statuses.worker.active == 3
    assert d.status.selector == (
        "elastic.pytorch.org/job-name=train,elastic.pytorch.org/replica-type=worker"
    )
    assert {"Created", "ProvisionedEtcd", "CreatedWorkers"} <= set(reasons(d))


def test_steady_state_round_changes_nothing_so_an_operator_restart_is_harmless() -> None:
    w = running_world(replicas=3)
    before = w.status.model_dump()
    for _ in range(3):
        w.advance(5)
        d = w.round()
        assert d.create == [] and d.delete == [] and d.events == []
        assert w.status.model_dump() == before


def test_running_condition_needs_min_replicas_running() -> None:
    w = World(make_spec(replicas=3, minReplicas=2))
    w.round()
    w.set(0, "Running")
    d = w.round()
    assert not d.status.is_true(C.RUNNING)
    assert cond(d.status, C.RUNNING).reason == "WaitingForWorkers"
    w.set(1, "Running")
    d = w.round()
    assert d.status.is_true(C.RUNNING)
    assert d.status.phase == "Running"
    assert d.status.replica_statuses.worker.active == 3


def test_user_endpoint_means_no_etcd_is_provisioned() -> None:
    w = World(make_spec(rdzvEndpoint="etcd-service:2379"))
    d = w.round()
    assert "train-etcd" not in [o["metadata"]["name"] for o in d.create]
    assert "ProvisionedEtcd" not in reasons(d)


def test_c10d_uses_worker_zero_and_no_etcd() -> None:
    spec = make_spec(rdzvBackend="c10d")
    d = World(spec).round()
    assert all(o["metadata"]["name"] != "train-etcd" for o in d.create)
    assert builders.rdzv_endpoint(REF, spec) == "train-worker-0.train-worker.ml.svc:29400"


def test_missing_service_or_etcd_is_recreated() -> None:
    w = running_world()
    w.services.clear()
    w.deployments.clear()
    d = w.round()
    assert sorted(o["metadata"]["name"] for o in d.create) == [
        "train-etcd",
        "train-etcd",
        "train-worker",
    ]
    assert pod_names(d) == []


# -- failures and restartPolicy --------------------------------------------------------


def test_on_failure_deletes_then_recreates_the_same_name_and_counts_it() -> None:
    w = running_world(replicas=2, backoffLimit=3)
    w.set(1, "Failed", code=1)
    d = w.round()
    assert deleted_pods(d) == ["train-worker-1"]
    assert pod_names(d) == []  # the name is taken until the old pod is gone
    assert d.status.replica_statuses.worker.failed == 1
    assert d.status.worker_indexes.replacing == [1]
    assert d.status.is_true(C.RESTARTING)
    assert d.status.phase == "Restarting"
    assert "RestartingWorker" in reasons(d)
    # still terminating: wait
    d = w.round()
    assert pod_names(d) == [] and d.status.restart_count == 0
    w.settle()
    d = w.round()
    assert pod_names(d) == ["train-worker-1"]
    assert d.status.restart_count == 1
    assert d.status.replica_statuses.worker.failed == 1  # not counted twice
    assert "ReplacedWorkers" in reasons(d)
    w.run_all()
    d = w.round()
    assert not d.status.is_true(C.RESTARTING)
    assert d.status.phase == "Running"


def test_a_deleted_pod_is_replaced_at_once_and_counted() -> None:
    w = running_world(replicas=3)
    del w.pods["train-worker-2"]
    d = w.round()
    assert pod_names(d) == ["train-worker-2"]
    assert d.status.restart_count == 1
    assert d.status.replica_statuses.worker.failed == 1
    assert "RestartingWorker" in reasons(d)


def test_a_pod_being_deleted_is_waited_for() -> None:
    w = running_world(replicas=2)
    name = "train-worker-0"
    w.pods[name] = replace(w.pods[name], terminating=True)
    d = w.round()
    assert d.create == [] and d.delete == []
    assert d.status.is_true(C.RESTARTING)


def test_backoff_limit_spent_fails_the_job_and_stops_running_workers() -> None:
    w = running_world(replicas=2, backoffLimit=1)
    w.set(0, "Failed", code=1)
    w.round()
    w.settle()
    w.round()
    w.run_all()
    w.round()
    assert w.status.restart_count == 1
    w.set(1, "Failed", code=1)
    d = w.round()
    assert d.status.is_true(C.FAILED)
    assert cond(d.status, C.FAILED).reason == "BackoffLimitExceeded"
    assert d.status.phase == "Failed"
    assert d.status.completion_time == w.now
    assert deleted_pods(d) == ["train-worker-0"]  # running one; the failed one stays for logs
    assert "BackoffLimitExceeded" in reasons(d)
    assert any(e.type == "Warning" for e in d.events)


def test_backoff_limit_zero_fails_on_the_first_failure() -> None:
    w = running_world(backoffLimit=0)
    w.set(0, "Failed", code=2)
    d = w.round()
    assert cond(d.status, C.FAILED).reason == "BackoffLimitExceeded"


def test_simultaneous_failures_share_the_backoff_budget() -> None:
    w = running_world(replicas=3, backoffLimit=1)
    w.set(0, "Failed", code=1)
    w.set(1, "Failed", code=1)
    d = w.round()
    assert d.status.is_true(C.FAILED)


def test_always_replaces_beyond_backoff_limit() -> None:
    w = running_world(replicas=2, backoffLimit=0, restartPolicy="Always")
    for n in range(3):
        w.set(0, "Failed", code=1)
        w.round()
        w.settle()
        d = w.round()
        assert pod_names(d) == ["train-worker-0"]
        assert d.status.restart_count == n + 1
        w.run_all()
    assert not w.status.finished


@pytest.mark.parametrize("code", [1, 2, 100, 127])
def test_exit_code_policy_fails_on_a_permanent_exit_code(code: int) -> None:
    w = running_world(restartPolicy="ExitCode")
    w.set(1, "Failed", code=code)
    d = w.round()
    assert cond(d.status, C.FAILED).reason == "PermanentError"
    assert f"exit code {code}" in cond(d.status, C.FAILED).message
    assert d.status.restart_count == 0


@pytest.mark.parametrize("code", [128, 137, 143, 255, None])
def test_exit_code_policy_retries_signals_and_lost_pods(code: int | None) -> None:
    w = running_world(restartPolicy="ExitCode")
    w.set(1, "Failed", code=code, reason="Evicted" if code is None else "")
    d = w.round()
    assert not d.status.finished
    assert deleted_pods(d) == ["train-worker-1"]
    w.settle()
    assert pod_names(w.round()) == ["train-worker-1"]


def test_never_does_not_replace_and_the_job_carries_on_above_min() -> None:
    w = running_world(replicas=3, minReplicas=2, restartPolicy="Never")
    w.set(2, "Failed", code=1)
    d = w.round()
    assert d.create == [] and d.delete == []  # failed pod kept for its logs
    assert d.status.worker_indexes.retired == [2]
    assert "WorkerRetired" in reasons(d)
    assert d.status.is_true(C.RUNNING)
    d = w.round()
    assert d.events == []  # retired once, not counted again
    assert d.status.replica_statuses.worker.failed == 1


def test_never_below_min_fails_after_the_grace_period() -> None:
    w = running_world(replicas=2, minReplicas=2, restartPolicy="Never")
    w.set(1, "Failed", code=1)
    d = w.round()
    assert d.status.below_min_since == w.now
    assert not d.status.finished
    w.advance(59)
    assert not w.round().status.finished
    w.advance(2)
    d = w.round()
    assert cond(d.status, C.FAILED).reason == "BelowMinReplicas"


def test_below_min_clock_resets_when_workers_come_back() -> None:
    w = running_world(replicas=2, minReplicas=2)
    del w.pods["train-worker-0"]
    del w.pods["train-worker-1"]
    # replaced at once: counted as active, so the clock never starts
    d = w.round()
    assert d.status.below_min_since is None
    assert pod_names(d) == ["train-worker-0", "train-worker-1"]


def test_a_deleted_pod_under_never_is_retired() -> None:
    w = running_world(replicas=3, restartPolicy="Never")
    del w.pods["train-worker-0"]
    d = w.round()
    assert pod_names(d) == []
    assert d.status.worker_indexes.retired == [0]


# -- scaling ---------------------------------------------------------------------------


def test_scale_up_creates_the_missing_indexes() -> None:
    w = running_world(replicas=2)
    w.spec = make_spec(replicas=4)
    d = w.round()
    assert pod_names(d) == ["train-worker-2", "train-worker-3"]
    assert d.status.is_true(C.SCALING)
    assert "Scaling" in reasons(d)
    assert d.status.restart_count == 0
    w.run_all()
    d = w.round()
    assert not d.status.is_true(C.SCALING)
    assert d.status.replica_statuses.worker.active == 4


def test_scale_down_removes_the_highest_indexes_first_without_counting_failures() -> None:
    w = running_world(replicas=4)
    w.spec = make_spec(replicas=1)
    d = w.round()
    assert deleted_pods(d) == ["train-worker-3", "train-worker-2", "train-worker-1"]
    assert d.status.replica_statuses.worker.active == 1
    assert d.status.worker_indexes.launched == [0]
    assert d.status.is_true(C.SCALING)
    w.settle()
    d = w.round()
    assert not d.status.is_true(C.SCALING)
    assert d.status.replica_statuses.worker.failed == 0
    assert d.status.restart_count == 0


def test_a_scale_down_marks_the_running_workers_it_deletes_leaving_and_no_other() -> None:
    w = running_world(replicas=4)
    for i in range(4):
        name = builders.worker_pod_name(REF.name, i)
        w.pods[name] = replace(w.pods[name], ip=f"10.0.0.{i}")
    w.set(3, "Pending")  # scheduled, no agent yet: nothing of it in the run's etcd
    w.spec = make_spec(replicas=1)
    d = w.round()
    assert deleted_pods(d) == ["train-worker-3", "train-worker-2", "train-worker-1"]
    assert d.leaving == ["10.0.0.1", "10.0.0.2"]
    w.settle()
    assert w.round().leaving == []  # nothing more to mark once they are gone


def test_a_round_that_deletes_no_pod_for_a_scale_down_marks_nobody() -> None:
    w = running_world(replicas=2)
    for i in range(2):
        name = builders.worker_pod_name(REF.name, i)
        w.pods[name] = replace(w.pods[name], ip=f"10.0.0.{i}")
    w.set(1, "Failed", code=1)  # deleted to be replaced: its agent has gone already
    d = w.round()
    assert deleted_pods(d) == ["train-worker-1"]
    assert d.leaving == []


def test_scaling_back_up_is_a_fresh_worker_not_a_restart() -> None:
    w = running_world(replicas=3)
    w.spec = make_spec(replicas=2)
    w.round()
    w.settle()
    w.round()
    w.spec = make_spec(replicas=3)
    d = w.round()
    assert pod_names(d) == ["train-worker-2"]
    assert d.status.restart_count == 0


def test_absent_replicas_means_min_replicas() -> None:
    spec = make_spec(replicas=None, minReplicas=2)
    assert spec.desired_replicas == 2
    assert pod_names(World(spec).round()) == ["train-worker-0", "train-worker-1"]


# -- suspend / resume ------------------------------------------------------------------


def test_suspend_deletes_pods_and_keeps_the_job() -> None:
    w = running_world(replicas=2)
    w.spec = make_spec(replicas=2, suspend=True)
    d = w.round()
    assert sorted(deleted_pods(d)) == ["train-worker-0", "train-worker-1"]
    assert d.status.is_true(C.SUSPENDED)
    assert d.status.phase == "Suspended"
    assert not d.status.is_true(C.RUNNING)
    assert not d.delete_job
    assert "Suspended" in reasons(d)
    w.settle()
    d = w.round()
    assert d.create == [] and d.events == []


def test_resume_starts_a_new_incarnation_with_a_new_rendezvous_id() -> None:
    w = running_world(replicas=2)
    w.spec = make_spec(replicas=2, suspend=True)
    w.round()
    w.spec = make_spec(replicas=2, suspend=False)
    w.advance(30)
    d = w.round()
    assert d.status.incarnation == 1
    assert pod_names(d) == []  # old pods still terminating
    assert "Resumed" in reasons(d)
    assert d.status.start_time == w.now
    w.settle()
    d = w.round()
    assert pod_names(d) == ["train-worker-0", "train-worker-1"]
    env = {e["name"]: e.get("value") for e in d.create[0]["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_ID"] == "uid-1-1"
    assert d.status.restart_count == 0


def test_pods_of_an_earlier_incarnation_are_deleted() -> None:
    w = running_world(replicas=2)
    w.status.incarnation = 1
    d = w.round()
    assert sorted(deleted_pods(d)) == ["train-worker-0", "train-worker-1"]
    assert "DeletedStalePods" in reasons(d)


# -- deadlines, success, cleanup, TTL --------------------------------------------------


def test_active_deadline_fails_and_stops_workers_even_with_clean_pod_policy_none() -> None:
    w = running_world(activeDeadlineSeconds=100, cleanPodPolicy="None")
    w.advance(99)
    assert not w.round().status.finished
    w.advance(1)
    d = w.round()
    assert cond(d.status, C.FAILED).reason == "DeadlineExceeded"
    assert sorted(deleted_pods(d)) == ["train-worker-0", "train-worker-1"]


def test_succeeds_once_every_worker_exited_zero() -> None:
    w = running_world(replicas=2)
    w.set(0, "Succeeded", code=0)
    d = w.round()
    assert not d.status.finished  # worker 1 still running
    w.set(1, "Succeeded", code=0)
    d = w.round()
    assert d.status.is_true(C.SUCCEEDED)
    assert d.status.phase == "Succeeded"
    assert d.status.completion_time == w.now
    assert d.status.replica_statuses.worker.succeeded == 2
    assert deleted_pods(d) == []  # nothing running to clean
    assert [r for r in d.delete if r.kind != "Pod"] == [
        ChildRef("Deployment", "train-etcd"),
        ChildRef("Service", "train-etcd"),
    ]


def test_after_the_first_success_nothing_is_replaced() -> None:
    w = running_world(replicas=3)
    w.set(0, "Succeeded", code=0)
    w.set(1, "Failed", code=1)
    d = w.round()
    assert d.create == [] and deleted_pods(d) == []
    assert "WorkerLeftAfterCompletion" in reasons(d)
    assert d.status.worker_indexes.retired == [1]
    w.set(2, "Succeeded", code=0)
    d = w.round()
    assert d.status.is_true(C.SUCCEEDED)
    assert "2 workers" in cond(d.status, C.SUCCEEDED).message


@pytest.mark.parametrize(
    ("policy", "deleted", "etcd_deleted"),
    [
        ("All", ["train-worker-1", "train-worker-0"], True),
        ("Running", ["train-worker-0"], True),
        ("None", [], False),
    ],
)
def test_clean_pod_policy_on_failure(policy: str, deleted: list[str], etcd_deleted: bool) -> None:
    w = running_world(replicas=2, cleanPodPolicy=policy, restartPolicy="ExitCode")
    w.set(1, "Failed", code=3)
    d = w.round()
    assert d.status.is_true(C.FAILED)
    assert deleted_pods(d) == deleted
    assert any(r.kind == "Deployment" for r in d.delete) == etcd_deleted


def test_finished_job_creates_nothing_more() -> None:
    w = running_world(restartPolicy="ExitCode", cleanPodPolicy="None")
    w.set(0, "Failed", code=1)
    w.round()
    del w.pods["train-worker-1"]
    w.services.clear()
    d = w.round()
    assert d.create == [] and d.delete == [] and d.events == []


def test_ttl_after_finished_deletes_the_job() -> None:
    w = running_world(ttlSecondsAfterFinished=60)
    w.set(0, "Succeeded", code=0)
    w.set(1, "Succeeded", code=0)
    assert not w.round().delete_job
    w.advance(59)
    assert not w.round().delete_job
    w.advance(1)
    d = w.round()
    assert d.delete_job
    assert "TTLExpired" in reasons(d)


INT64_MAX = 2**63 - 1  # the API server accepts any int64 for these


def test_an_int64_deadline_or_ttl_is_never_reached_and_never_breaks_a_round() -> None:
    # They used to be added to a datetime, which overflowed: every round raised and the
    # job was never reconciled again.
    w = running_world(activeDeadlineSeconds=INT64_MAX, ttlSecondsAfterFinished=INT64_MAX)
    w.advance(10**6)
    assert w.round().status.phase == "Running"
    w.set(0, "Succeeded", code=0)
    w.set(1, "Succeeded", code=0)
    d = w.round()
    assert d.status.phase == "Succeeded" and not d.delete_job
    w.advance(10**6)
    assert not w.round().delete_job


def test_no_ttl_keeps_the_job() -> None:
    w = running_world()
    w.set(0, "Succeeded", code=0)
    w.set(1, "Succeeded", code=0)
    w.round()
    w.advance(10**6)
    assert not w.round().delete_job


# -- odd observations ------------------------------------------------------------------


def test_a_foreign_pod_holding_a_name_is_never_touched() -> None:
    w = World(make_spec(replicas=1))
    w.pods["train-worker-0"] = ObservedPod("train-worker-0", 0, "Running", foreign=True)
    d = w.round()
    assert pod_names(d) == [] and deleted_pods(d) == []


def test_invalid_spec_fails_the_job_once() -> None:
    d = invalid_spec(models.ElasticJobStatus(), "spec.minReplicas: too big", T0)
    assert cond(d.status, C.FAILED).reason == "InvalidSpec"
    assert d.status.phase == "Failed"
    again = invalid_spec(d.status, "spec.minReplicas: too big", T0)
    assert again.events == []


def test_condition_transition_time_moves_only_when_status_flips() -> None:
    s = models.ElasticJobStatus()
    set_condition(s, C.RUNNING, True, "A", "m1", T0)
    set_condition(s, C.RUNNING, True, "A", "m2", T0 + timedelta(seconds=5))
    assert cond(s, C.RUNNING).last_transition_time == T0
    assert cond(s, C.RUNNING).message == "m2"
    set_condition(s, C.RUNNING, False, "B", "m3", T0 + timedelta(seconds=9))
    assert cond(s, C.RUNNING).last_transition_time == T0 + timedelta(seconds=9)
    set_condition(s, C.SCALING, False, "X", "never true", T0)
    assert s.condition(C.SCALING) is None


def progress_record(now: datetime, **values: Any) -> bytes:
    """What rank 0 stores in etcd (the runtime's own encoder)."""
    values.setdefault("samples_per_second", 12.5)
    values.setdefault("world_size", 4)
    values.setdefault("restart_count", 0)
    return encode_progress(Progress(updated=now.timestamp(), **values))


def test_progress_is_mirrored_and_a_repeated_value_does_not_rewrite_status() -> None:
    w = running_world()
    p1 = progress_of(progress_record(w.now, step=10))
    d = w.round(progress=p1)
    assert d.status.progress is not None
    assert (d.status.progress.step, d.status.progress.world_size) == (10, 4)
    w.advance(10)
    same = progress_of(progress_record(w.now, step=10))  # republished, nothing new
    d = w.round(progress=same)
    assert d.status.progress is not None and d.status.progress.update_time == T0
    d = w.round(progress=None)
    assert d.status.progress is not None and d.status.progress.step == 10


def test_progress_reads_the_runtimes_record() -> None:
    record = {
        "step": 42,
        "samples_per_second": 100.5,
        "world_size": 6,
        "restart_count": 1,
        "updated": T0.timestamp() + 3.7,
        "epoch": 2,
        "checkpoint_step": 40,
        "checkpoint_url": "http://10.244.0.5:8090/checkpoint",
    }
    p = progress_of(json.dumps(record).encode())
    assert p is not None
    assert (p.step, p.world_size, p.epoch, p.checkpoint_step) == (42, 6, 2, 40)
    assert (p.samples_per_second, p.trainer_restarts) == (100.5, 1)
    assert p.update_time == T0 + timedelta(seconds=3)
    assert p.checkpoint_error is None
    failing = {**record, "checkpoint_error": "checkpoint step 42 not saved in /ckpt: EROFS"}
    p = progress_of(json.dumps(failing).encode())
    assert p is not None and p.checkpoint_error == failing["checkpoint_error"]
    assert p.model_dump(by_alias=True)["checkpointError"] == failing["checkpoint_error"]


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"step": "many", "samples_per_second": 1, "world_size": 2, "restart_count": 0, '
        b'"updated": 1}',
        b'{"step": 1, "world_size": 2, "restart_count": 0, "updated": 1}',
        b'{"step": Infinity, "samples_per_second": 1, "world_size": 2, "restart_count": 0, '
        b'"updated": 1}',
        b'{"step": 1, "samples_per_second": NaN, "world_size": 2, "restart_count": 0, '
        b'"updated": 1}',
        b'{"step": 1, "samples_per_second": 1, "world_size": 2, "restart_count": 0, '
        b'"updated": 1e300}',
    ],
)
def test_a_malformed_progress_record_is_no_progress_this_round(raw: bytes) -> None:
    w = running_world()
    w.round(progress=progress_of(progress_record(w.now, step=10)))
    assert progress_of(raw) is None
    d = w.round(progress=progress_of(raw))
    assert d.status.progress is not None and d.status.progress.step == 10


def test_goodput_is_the_runtimes_ledger_with_the_wait_before_its_first_agent() -> None:
    w = running_world()  # created at T0
    t0 = T0.timestamp()
    book = gl.committed(gl.opened(t0 + 30), 1, t0 + 40)  # the agent started 30 s in
    book = gl.interrupted(gl.committed(book, 2, t0 + 70), "failure", t0 + 71)
    book = gl.committed(gl.paused(book, t0 + 75), 3, t0 + 100)  # its first step after
    raw = progress_record(w.now, step=3, ledger=gl.encode(book))
    d = w.round(progress=progress_of(raw), ledger=ledger_of(raw))
    g = d.status.goodput
    assert g is not None
    assert (g.waiting_seconds, g.startup_seconds, g.wall_seconds) == (30, 10, 100)
    # 30 s of steps, the step in flight lost (1 s), the regroup (4 s), then a 25 s step
    assert g.training_seconds == 55
    assert g.lost_seconds == 1 and g.paused_seconds == {"failure": 4}
    assert g.recoveries == {"failure": 1} and g.longest_pause_seconds == 5
    assert (g.ratio, g.percent) == (0.55, "55.0%")
    assert g.through_time == T0 + timedelta(seconds=100)
    assert g.run_id == models.run_id(REF.uid, 0)
    assert g.last_recovery is not None and g.last_recovery.step == 3
    assert d.status.model_dump(by_alias=True)["goodput"]["pausedSeconds"] == {"failure": 4}
    said = [e for e in d.events if e.reason == "Recovered"]
    assert [e.message for e in said] == [
        "a worker or a node failed: training paused 5.0 s, going on at step 3"
    ]
    d = w.round(progress=progress_of(raw), ledger=ledger_of(raw))  # read again: said once
    assert "Recovered" not in reasons(d)
    d = w.round()  # not read this round: kept
    assert d.status.goodput == g
    two = gl.committed(gl.paused(gl.interrupted(book, "join", t0 + 101), t0 + 103), 4, t0 + 130)
    two = gl.committed(gl.interrupted(two, "departure", t0 + 131), 5, t0 + 160)
    raw = progress_record(w.now, step=5, ledger=gl.encode(two))
    d = w.round(progress=progress_of(raw), ledger=ledger_of(raw))
    assert [e.message for e in d.events if e.reason == "Recovered"] == [
        "workers left: training paused 1.0 s, going on at step 5 (2 recoveries since the "
        "last report)"
    ]


def test_a_jobs_wall_time_starts_at_its_creation_not_at_the_operators_first_round() -> None:
    """The Created condition comes with the operator's first round, a moment (or, for a
    busy operator, much) after the job was created; the creation is when the user's
    wait began."""
    w = running_world()  # the Created condition at T0
    t0 = T0.timestamp()
    book = gl.committed(gl.opened(t0 + 30), 1, t0 + 40)
    raw = progress_record(w.now, step=1, ledger=gl.encode(book))
    observed = replace(
        w.observed(progress_of(raw), ledger_of(raw)), created=T0 - timedelta(seconds=3)
    )
    d = reconcile(REF, 1, w.spec, w.status, observed, w.now, w.config)
    g = d.status.goodput
    assert g is not None and (g.waiting_seconds, g.wall_seconds) == (33, 43)


def test_a_resumed_job_adds_its_new_run_to_the_earlier_ones_and_the_suspension_waits() -> None:
    w = running_world()
    t0 = T0.timestamp()
    book = gl.interrupted(
        gl.committed(gl.committed(gl.opened(t0), 1, t0 + 1), 2, t0 + 2), "join", t0 + 3
    )
    book = gl.committed(book, 3, t0 + 4)
    raw = progress_record(w.now, step=3, ledger=gl.encode(book))
    first = w.round(progress=progress_of(raw), ledger=ledger_of(raw)).status.goodput
    assert first is not None and first.runs == 1 and first.earlier is None
    # a later run (resumed after a suspension) that has recovered once: its own event,
    # although the earlier run's count was already one
    w.status.incarnation = 1
    set_condition(w.status, C.SUSPENDED, True, "Suspended", "", T0 + timedelta(seconds=30))
    set_condition(w.status, C.SUSPENDED, False, "Resumed", "", T0 + timedelta(seconds=60))
    later = gl.committed(gl.committed(gl.opened(t0 + 70), 2, t0 + 80), 3, t0 + 81)
    later = gl.committed(gl.interrupted(later, "failure", t0 + 82), 4, t0 + 84)
    raw = progress_record(w.now, step=4, ledger=gl.encode(later))
    d = w.round(progress=progress_of(raw), ledger=ledger_of(raw))
    assert "Recovered" in reasons(d)
    g = d.status.goodput
    assert g is not None and g.run_id == models.run_id(REF.uid, 1) and g.runs == 2
    # the job's wall time from its creation: the time from the first run's last entry to
    # the second's first agent was the suspension (and the wait to be scheduled again)
    assert g.wall_seconds == 84 and g.waiting_seconds == 66
    assert g.startup_seconds == 1 + 10
    assert g.recoveries == {"failure": 1, "join": 1}
    buckets = g.training_seconds + g.waiting_seconds + g.startup_seconds + g.lost_seconds
    buckets += g.checkpoint_seconds + sum(g.paused_seconds.values())
    assert buckets == pytest.approx(g.wall_seconds)
    assert g.earlier is not None and g.earlier.through_time == T0 + timedelta(seconds=4)
    assert [(m.cause, m.from_step, m.step) for m in g.timeline] == [
        ("start", 0, 1),
        ("join", 2, 3),
        ("suspended", 3, 2),
        ("start", 0, 2),
        ("failure", 3, 4),
    ]
    d = w.round(progress=progress_of(raw), ledger=ledger_of(raw))  # read again: the same
    assert d.status.goodput == g and "Recovered" not in reasons(d)


@pytest.mark.parametrize(
    "ledger",
    [
        {"opened": "yesterday"},
        {"opened": 1e13, "through": 1e13, "training": 0, "startup": 0, "lost": 0,
         "checkpoint": 0, "step": 1, "longest_pause": 0},
    ],
)  # fmt: skip
def test_a_malformed_ledger_costs_the_ledger_not_the_progress(ledger: dict[str, Any]) -> None:
    raw = progress_record(T0, step=3, ledger=ledger)
    assert ledger_of(raw) is None
    p = progress_of(raw)
    assert p is not None and p.step == 3


# -- node memory -----------------------------------------------------------------------

MiB = 2**20


def too_big(pod: str, step: int = 20, size: int = 300 * MiB, **kw: Any) -> MemoryFallback:
    kw.setdefault("shm_bytes", 64 * MiB)
    kw.setdefault("free_bytes", 60 * MiB)
    kw.setdefault("no_space", True)
    kw.setdefault("error", "")
    return MemoryFallback(pod=pod, step=step, checkpoint_bytes=size, updated=0.0, **kw)


def fallback_round(w: World, *reports: MemoryFallback) -> Decision:
    """A round in which the operator read these reports from the run's etcd."""
    observed = replace(w.observed(), memory_fallbacks=reports)
    d = reconcile(REF, 1, w.spec, w.status, observed, w.now, w.config)
    w.status = d.status
    return d


def warnings_about_memory(d: Decision) -> list[str]:
    return [
        e.message
        for e in d.events
        if e.type == "Warning" and e.reason == "CheckpointNotInNodeMemory"
    ]


def test_a_checkpoint_too_big_for_node_memory_is_one_warning_event_per_run() -> None:
    w = running_world(shmSize="64Mi")
    reports = (too_big("train-worker-1"), too_big("train-worker-0"), too_big("w-9", step=30))
    [message] = warnings_about_memory(fallback_round(w, *reports))
    assert message == (
        "worker train-worker-0: checkpoint step 20 (300 MiB) does not fit in a /dev/shm of "
        "64 MiB (60 MiB free), so restarts on that node read the checkpoint directory instead "
        "of node memory: raise spec.shmSize (64Mi) to at least 768Mi; pods created after the "
        "change get it"
    )
    said = w.status.node_memory_fallback
    assert said is not None
    assert (said.run_id, said.pod, said.step, said.checkpoint_bytes) == (
        "uid-1",
        "train-worker-0",
        20,
        300 * MiB,
    )
    assert said.message == message and said.time == T0
    for _ in range(3):  # every resync reads the reports again: nothing more is said
        w.advance(10)
        assert warnings_about_memory(fallback_round(w, *reports)) == []
    assert w.status.node_memory_fallback == said
    assert warnings_about_memory(fallback_round(w)) == []  # nothing read: status stays
    assert w.status.node_memory_fallback == said


def test_a_new_run_after_resume_is_told_again() -> None:
    w = running_world()
    assert len(warnings_about_memory(fallback_round(w, too_big("train-worker-0")))) == 1
    w.spec = make_spec(suspend=True)
    w.round()
    w.settle()
    w.spec = make_spec()
    w.round()
    assert w.status.incarnation == 1
    [message] = warnings_about_memory(fallback_round(w, too_big("train-worker-1", step=50)))
    assert "train-worker-1: checkpoint step 50" in message
    said = w.status.node_memory_fallback
    assert said is not None and said.run_id == "uid-1-1"


def test_the_advice_follows_what_the_template_does_with_dev_shm() -> None:
    off = fallback_round(running_world(shmSize="0"), too_big("w", size=900 * MiB))
    [message] = warnings_about_memory(off)
    assert "set spec.shmSize to at least 2Gi (0 keeps the runtime's 64 MiB /dev/shm)" in message
    raw = make_spec().model_dump(mode="json", by_alias=True)
    pod = raw["replicaSpecs"]["Worker"]["template"]["spec"]
    pod["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": "/dev/shm"}]
    pod["volumes"] = [{"name": "mine", "emptyDir": {"medium": "Memory"}}]
    w = World(models.ElasticJobSpec.model_validate(raw))
    w.round()
    [message] = warnings_about_memory(fallback_round(w, too_big("w", size=3 * 2**30)))
    assert "give the /dev/shm the pod template mounts at least 7Gi" in message
    other = too_big("w", no_space=False, error="[Errno 30] Read-only file system")
    [message] = warnings_about_memory(fallback_round(running_world(), other))
    assert message == (
        "worker w: the node-memory copy of checkpoint step 20 failed ([Errno 30] Read-only "
        "file system); restarts on that node read the checkpoint directory"
    )


@pytest.mark.parametrize(
    ("size", "limit"),
    [
        (1, "256Mi"),
        (100 * MiB, "256Mi"),
        (300 * MiB, "768Mi"),
        (500 * MiB, "2Gi"),
        (3 << 30, "7Gi"),
    ],
)
def test_the_suggested_shm_size_holds_two_copies_and_some_room(size: int, limit: str) -> None:
    assert suggested_shm_size(size) == limit
    assert models.quantity_bytes(limit) >= 2.2 * size


def test_memory_fallback_reads_the_runtimes_report_and_refuses_junk() -> None:
    record = {
        "pod": "train-worker-2",
        "step": 40,
        "checkpoint_bytes": 123,
        "shm_bytes": 67108864,
        "free_bytes": None,
        "no_space": True,
        "error": "[Errno 28] No space left on device",
        "updated": 1.5,
    }
    junk = [{**record, "step": "forty"}, {**record, "pod": ""}, {"pod": "p"}]
    raws = [json.dumps(r).encode() for r in [record, *junk]] + [b"{"]
    assert memory_fallbacks_of(raws) == (
        MemoryFallback(
            "train-worker-2",
            40,
            123,
            67108864,
            None,
            True,
            "[Errno 28] No space left on device",
            1.5,
        ),
    )


# -- observation helpers ---------------------------------------------------------------


def raw_pod(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "train-worker-3",
            "labels": {builders.LABEL_INDEX: "3", builders.LABEL_INCARNATION: "2"},
            "ownerReferences": [{"uid": "uid-1"}],
        },
        "spec": {"containers": [{"name": "trainer"}, {"name": "sidecar"}]},
        "status": status,
    }


def terminated(name: str, code: int) -> dict[str, Any]:
    return {"name": name, "state": {"terminated": {"exitCode": code}}}


def test_exit_code_is_the_trainers_even_if_a_sidecar_failed_first() -> None:
    pod = raw_pod(containerStatuses=[terminated("sidecar", 9), terminated("trainer", 137)])
    assert exit_code(pod) == 137
    assert exit_code(raw_pod(containerStatuses=[terminated("sidecar", 9)])) == 9
    assert exit_code(raw_pod()) is None


def test_observe_pod_reads_index_phase_owner_and_deletion() -> None:
    pod = raw_pod(phase="Failed", reason="Evicted")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    p = observe_pod(pod, "uid-1")
    assert p == ObservedPod(
        name="train-worker-3",
        index=3,
        phase="Failed",
        terminating=True,
        exit_code=None,
        reason="Evicted",
        incarnation=2,
        foreign=False,
        deletion_deadline=datetime(2026, 1, 1, tzinfo=UTC),
        disruption="Evicted",  # the kubelet took it: not the worker's failure
    )
    other = observe_pod(raw_pod(phase="Running"), "uid-2")
    assert other is not None and other.foreign
    running = observe_pod(raw_pod(phase="Running", podIP="10.244.1.7"), "uid-1")
    assert running is not None and running.ip == "10.244.1.7"  # its agent's address
    unlabelled = raw_pod()
    unlabelled["metadata"]["labels"] = {}
    assert observe_pod(unlabelled, "uid-1") is None


# -- a property over random histories --------------------------------------------------

ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.integers(0, 5), st.sampled_from([1, 137, None])),
        st.tuples(st.just("delete"), st.integers(0, 5), st.none()),
        st.tuples(st.just("scale"), st.integers(1, 5), st.none()),
        st.tuples(st.just("run"), st.integers(0, 0), st.none()),
        st.tuples(st.just("settle"), st.integers(0, 0), st.none()),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(actions=ACTIONS, policy=st.sampled_from(["OnFailure", "Always", "Never", "ExitCode"]))
def test_random_histories_keep_the_invariants(actions: list[Any], policy: str) -> None:
    """Whatever happens: one pod per index, no index past `replicas` is created, the
    backoff limit holds, and a world left alone reaches a fixed point."""
    limit = 3
    w = World(make_spec(replicas=3, maxReplicas=5, restartPolicy=policy, backoffLimit=limit))
    w.round()
    for kind, arg, code in actions:
        if w.status.finished:
            break
        name = builders.worker_pod_name(REF.name, arg)
        if kind == "fail" and name in w.pods and not w.pods[name].terminating:
            w.set(arg, "Failed", code=code)
        elif kind == "delete":
            w.pods.pop(name, None)
        elif kind == "scale":
            w.spec = make_spec(
                replicas=arg, maxReplicas=5, restartPolicy=policy, backoffLimit=limit
            )
        elif kind == "run":
            for p in list(w.pods.values()):
                if p.phase == "Pending":
                    w.set(p.index, "Running")
        elif kind == "settle":
            w.settle()
        d = w.round()
        created = [
            o["metadata"]["labels"][builders.LABEL_INDEX] for o in d.create if o["kind"] == "Pod"
        ]
        assert all(int(i) < w.spec.desired_replicas for i in created)
        assert len(w.pods) == len({p.index for p in w.pods.values()})
        if policy != "Always":
            assert w.status.restart_count <= limit
    # leave the world alone: terminating pods go, pending pods run; then nothing changes
    for _ in range(4):
        w.settle()
        for p in list(w.pods.values()):
            if p.phase == "Pending":
                w.set(p.index, "Running")
        w.round()
    w.settle()
    d = w.round()
    assert d.create == [] and d.delete == [] and d.events == []


# -- pods on a lost node -----------------------------------------------------------------


def pod_with_conditions(
    ready: str, containers_ready: str, reason: str = "", phase: str = "Running"
) -> dict[str, Any]:
    ready_cond = {"type": "Ready", "status": ready, "lastTransitionTime": "2026-01-01T12:00:00Z"}
    if reason:
        ready_cond["reason"] = reason
    containers = {"type": "ContainersReady", "status": containers_ready}
    return raw_pod(phase=phase, conditions=[ready_cond, containers])


def test_a_pod_the_node_controller_marked_not_ready_is_seen_as_on_a_lost_node() -> None:
    marked = observe_pod(pod_with_conditions("False", "True"), REF.uid)
    assert marked is not None and marked.node_lost_since == T0
    # what a kubelet reports itself is not a lost node
    for pod in (
        pod_with_conditions("True", "True"),
        pod_with_conditions("False", "False", reason="ContainersNotReady"),
        pod_with_conditions("False", "True", reason="ReadinessGatesNotReady"),
        pod_with_conditions("False", "True", phase="Succeeded"),
    ):
        seen = observe_pod(pod, REF.uid)
        assert seen is not None and seen.node_lost_since is None, pod


def lose(w: World, i: int, terminating: bool = False) -> str:
    name = builders.worker_pod_name(REF.name, i)
    w.pods[name] = replace(w.pods[name], node_lost_since=w.now, terminating=terminating)
    return name


def test_a_worker_on_a_lost_node_is_force_deleted_after_the_grace_and_replaced() -> None:
    w = running_world(replicas=2, backoffLimit=3)
    w.config = Config(below_min_grace_seconds=60, node_lost_grace_seconds=10)
    name = lose(w, 1)
    w.advance(5)
    d = w.round()
    assert d.delete == [] and d.create == []  # a short blip of the node is tolerated
    w.advance(5)
    d = w.round()
    assert d.delete == [ChildRef("Pod", name, force=True)]
    assert d.status.replica_statuses.worker.failed == 1
    assert any("stopped responding" in e.message for e in d.events)
    w.settle()  # a force-deleted pod is gone at once
    d = w.round()
    assert pod_names(d) == [name]
    assert d.status.restart_count == 1


def test_a_terminating_pod_on_a_lost_node_is_force_deleted_not_waited_for() -> None:
    w = running_world(replicas=2)
    name = lose(w, 0, terminating=True)  # e.g. evicted, or deleted by a user
    d = w.round()
    assert d.delete == []  # within the grace: wait, as for any terminating pod
    w.advance(10)
    d = w.round()
    assert d.delete == [ChildRef("Pod", name, force=True)]
    assert "ForceDeletedPod" in reasons(d)
    del w.pods[name]
    d = w.round()
    assert pod_names(d) == [name]


def test_a_round_that_stops_at_a_create_still_says_what_it_deleted() -> None:
    """The deletes come before the creates: if a create fails, the next round finds the
    pods gone and would never say so (an e2e run once missed its ForceDeletedPod event).
    Each delete's event names the pod it reports, and only those events are posted."""
    w = running_world(replicas=2, backoffLimit=3)
    w.config = Config(below_min_grace_seconds=60, node_lost_grace_seconds=10)
    name = lose(w, 1, terminating=True)
    w.advance(10)
    d = w.round()
    deleted = {c.key for c in d.delete}
    assert deleted == {f"Pod/{name}"}
    assert [e.reason for e in reported(d.events, set(), deleted)] == ["ForceDeletedPod"]
    assert reported(d.events, set(), set()) == []  # a delete that failed: nothing said
    assert reported(d.events, deleted, set()) == []  # created is not deleted
    w = running_world(replicas=2, backoffLimit=3)
    w.config = Config(below_min_grace_seconds=60, node_lost_grace_seconds=10)
    name = lose(w, 1)
    w.advance(10)
    d = w.round()  # a worker failed with its node: its own event reports the delete
    said = reported(d.events, set(), {c.key for c in d.delete})
    assert any("stopped responding" in e.message for e in said), d.events


def test_a_pod_still_terminating_past_its_deletion_deadline_is_force_deleted_and_replaced() -> None:
    """A pod that was not ready when its node died (its agent still starting) is never
    marked by the node controller; the taint manager evicts it (the operator gives worker
    pods a short toleration of an unreachable node), and no kubelet confirms the delete."""
    w = running_world(replicas=2)
    w.config = Config(below_min_grace_seconds=60, node_lost_grace_seconds=10)
    name = builders.worker_pod_name(REF.name, 1)
    w.pods[name] = replace(w.pods[name], terminating=True, deletion_deadline=w.now)
    d = w.round()
    assert d.delete == []  # a live kubelet finishes the delete about now: wait for it
    w.advance(10)
    d = w.round()
    assert d.delete == [ChildRef("Pod", name, force=True)]
    assert "ForceDeletedPod" in reasons(d)
    del w.pods[name]
    d = w.round()
    assert pod_names(d) == [name]
    assert d.status.restart_count == 1


# -- the decisions on their own --------------------------------------------------------


def test_scaling_says_which_way_and_removes_what_is_past_the_end() -> None:
    pods = [ObservedPod(f"train-worker-{i}", i, "Running") for i in range(4)]
    down = decide_scaling(4, 2, pods)
    assert down.event is not None and down.event.message == "scaling down from 4 to 2 workers"
    assert [p.index for p in down.past_end] == [2, 3] and down.in_progress
    up = decide_scaling(2, 5, pods)
    assert up.event is not None and up.event.message == "scaling up from 2 to 5 workers"
    assert up.past_end == () and up.in_progress
    first = decide_scaling(None, 4, pods)  # the first round is not a scale
    assert (first.event, first.past_end, first.in_progress) == (None, (), False)
    # pods still going after a scale-down keep the condition on
    assert decide_scaling(2, 2, pods).in_progress


@pytest.mark.parametrize(
    ("policy", "stop_workers", "doomed", "etcd"),
    [
        ("All", False, ["train-worker-2", "train-worker-1", "train-worker-0"], True),
        ("Running", False, ["train-worker-2", "train-worker-0"], True),
        ("None", False, [], False),
        ("None", True, ["train-worker-2", "train-worker-0"], False),  # a deadline
    ],
)
def test_finishing_cleans_up_per_clean_pod_policy(
    policy: str, stop_workers: bool, doomed: list[str], etcd: bool
) -> None:
    spec = make_spec(cleanPodPolicy=policy, ttlSecondsAfterFinished=60)
    pods = [
        ObservedPod("train-worker-0", 0, "Running"),
        ObservedPod("train-worker-1", 1, "Failed"),
        ObservedPod("train-worker-2", 2, "Pending"),
        ObservedPod("train-worker-3", 3, "Running", terminating=True),
        ObservedPod("train-worker-4", 4, "Running", foreign=True),
    ]
    observed = Observed(services=frozenset({"train-etcd"}), deployments=frozenset({"train-etcd"}))
    f = decide_finish(REF, spec, pods, observed, frozenset(), T0, T0, stop_workers)
    assert [p.name for p in f.pods] == doomed
    assert bool(f.children) == etcd
    assert not f.delete_job
    later = decide_finish(
        REF, spec, pods, observed, frozenset(doomed), T0, T0 + timedelta(seconds=60)
    )
    assert later.delete_job and later.pods == ()
    assert [e.reason for e in later.events][-1] == "TTLExpired"


def test_the_below_min_clock_runs_only_while_below_min() -> None:
    spec = make_spec(replicas=3, minReplicas=2)
    mine = {0: ObservedPod("train-worker-0", 0, "Running")}
    ctx = worker_context("train", spec, 0, 0, models.WorkerIndexes(launched=[0]), mine, frozenset())
    workers = WorkerRound(mine, (), ctx, frozenset(), scaling=False)
    since = T0 - timedelta(seconds=30)
    waiting = decide_outcome(spec, workers, since, T0, grace=60)
    assert (waiting.verdict, waiting.below_min_since, waiting.active) == (
        Verdict.RUNNING,
        since,
        1,
    )
    over = decide_outcome(spec, workers, since, T0 + timedelta(seconds=30), grace=60)
    assert over.verdict is Verdict.BELOW_MIN
    assert over.message == "only 1 workers active, fewer than minReplicas=2, for more than 60s"
    enough = {i: ObservedPod(f"train-worker-{i}", i, "Running") for i in range(2)}
    ctx2 = worker_context("train", spec, 0, 0, models.WorkerIndexes(), enough, frozenset())
    back = decide_outcome(spec, WorkerRound(enough, (), ctx2, frozenset(), False), since, T0, 60)
    assert back.below_min_since is None
    assert [(c.type, c.value) for c in back.conditions] == [
        (C.RESTARTING, False),
        (C.SCALING, False),
        (C.RUNNING, True),
    ]


# -- divergence ------------------------------------------------------------------------


def test_ranks_that_diverged_fail_the_job_and_stop_its_workers() -> None:
    w = running_world()
    line = "the ranks trained different models: at step 13 ... 'optim' differs"
    record = Divergence(step=13, action="stop", message=line, pod="train-worker-0", updated=0)
    d = reconcile(
        REF, 1, w.spec, w.status, replace(w.observed(), divergences=(record,)), w.now, w.config
    )
    assert d.status.is_true(C.FAILED)
    failed = d.status.condition(C.FAILED)
    assert failed is not None and failed.reason == "Diverged" and line in failed.message
    assert [e.reason for e in d.events if e.type == "Warning"] == ["Diverged"]
    assert {ref.name for ref in d.delete if ref.kind == "Pod"}  # running workers stopped


# -- hangs -----------------------------------------------------------------------------


def test_a_hang_the_agents_recorded_is_one_warning_event_and_counted() -> None:
    w = running_world(hangTimeoutSeconds=30)
    record = Hang(
        round=4, pod="train-worker-1", step=99, stalled_seconds=30.5, timeout_seconds=30, updated=0
    )
    for expected in (1, 0, 0):  # every resync reads the record again: said once
        d = reconcile(
            REF, 1, w.spec, w.status, replace(w.observed(), hangs=(record,)), w.now, w.config
        )
        w.status = d.status
        hangs = [e for e in d.events if e.type == "Warning" and e.reason == "HangDetected"]
        assert len(hangs) == expected
        assert w.status.hangs is not None and w.status.hangs.count == 1


# -- stuck workers ---------------------------------------------------------------------


def test_a_worker_the_kubelet_cannot_start_is_one_warning_and_named_in_running() -> None:
    w = World(make_spec(replicas=2, minReplicas=2))
    w.round()
    missing = Waiting("trainer", "CreateContainerConfigError", 'secret "token" not found')
    for i in (0, 1):
        name = builders.worker_pod_name(REF.name, i)
        w.pods[name] = replace(w.pods[name], waiting=(missing,))
    for expected in (2, 0, 0):  # every resync sees the same pods: warned once each
        w.advance(10)
        d = w.round()
        stuck = [e for e in d.events if e.type == "Warning" and e.reason == "WorkerStuck"]
        assert len(stuck) == expected
    running = cond(w.status, C.RUNNING)
    assert (running.status, running.reason) == ("False", "WaitingForWorkers")
    assert running.message == (
        "0 of 2 workers running (minReplicas 2); "
        'train-worker-0: CreateContainerConfigError (container trainer): secret "token" '
        "not found; train-worker-1: CreateContainerConfigError (container trainer): secret "
        '"token" not found'
    )
    assert [s.pod for s in w.status.stuck_workers or []] == ["train-worker-0", "train-worker-1"]
    assert w.status.replica_statuses.worker.active == 2  # still pending: not failures
    for name in list(w.pods):  # the Secret was created: they start
        w.pods[name] = replace(w.pods[name], phase="Running", waiting=())
    d = w.round()
    assert cond(d.status, C.RUNNING).message == "2 of 2 workers running (minReplicas 2)"
    assert "WorkerStuck" not in reasons(d)


def test_suspending_forgets_the_stuck_workers_so_the_next_run_is_warned_again() -> None:
    w = World(make_spec(replicas=1))
    w.round()
    name = builders.worker_pod_name(REF.name, 0)
    pull = Waiting("trainer", "ImagePullBackOff", 'Back-off pulling image "nope"')
    w.pods[name] = replace(w.pods[name], waiting=(pull,))
    assert "WorkerStuck" in reasons(w.round())
    w.spec = make_spec(replicas=1, suspend=True)
    w.round()
    w.settle()
    assert w.status.stuck_workers is None
    w.spec = make_spec(replicas=1)
    w.round()
    w.pods[name] = replace(w.pods[name], waiting=(pull,))
    assert "WorkerStuck" in reasons(w.round())


def test_a_disruption_budget_keeps_evictions_above_min_replicas_when_asked_for() -> None:
    w = World(make_spec(replicas=3, podDisruptionBudget=True))
    d = w.round()
    (budget,) = [o for o in d.create if o["kind"] == "PodDisruptionBudget"]
    assert budget["metadata"]["name"] == "train-workers"
    assert budget["spec"]["minAvailable"] == 1  # minReplicas
    assert budget["spec"]["selector"]["matchLabels"] == builders.worker_selector("train")
    observed = replace(w.observed(), disruption_budgets=frozenset({"train-workers"}))
    again = reconcile(REF, 1, w.spec, w.status, observed, w.now, w.config)
    assert not [o for o in again.create if o["kind"] == "PodDisruptionBudget"]
    plain = World(make_spec(replicas=3)).round()
    assert not [o for o in plain.create if o["kind"] == "PodDisruptionBudget"]
