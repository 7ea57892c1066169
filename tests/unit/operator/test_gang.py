"""Gang placement by kube-scheduler: the rule, the Workload, and what a round does with it.

kube-scheduler's side (binding minCount pods together or none) runs on kind:
tests/e2e/test_kube_scheduler.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from elasticjob_operator import builders, gang, models, refusals
from elasticjob_operator.builders import JobRef
from elasticjob_operator.decision import ChildRef, Decision
from elasticjob_operator.kube import RESOURCES, merge_patch, resource_key
from elasticjob_operator.observe import Observed, ObservedPod
from elasticjob_operator.reconcile import Config, reconcile
from elasticjob_operator.settings import from_env

REF = JobRef(name="train", namespace="ml", uid="uid-1")
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
GANG_ON = Config(gang=True)


def spec(min_replicas: int = 2, replicas: int = 3) -> models.ElasticJobSpec:
    return models.ElasticJobSpec.model_validate(
        {
            "minReplicas": min_replicas,
            "maxReplicas": 4,
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "template": {"spec": {"containers": [{"name": "t", "image": "img"}]}},
                }
            },
        }
    )


def round_of(
    config: Config,
    status: models.ElasticJobStatus | None = None,
    observed: Observed | None = None,
    job: models.ElasticJobSpec | None = None,
    queue: str | None = None,
) -> Decision:
    return reconcile(
        REF,
        1,
        job or spec(),
        status or models.ElasticJobStatus(),
        observed or Observed(),
        T0,
        config,
        queue=queue,
    )


def created(d: Decision, kind: str, api_version: str | None = None) -> list[dict[str, Any]]:
    return [
        o
        for o in d.create
        if o["kind"] == kind and (api_version is None or o["apiVersion"] == api_version)
    ]


def test_a_new_job_gets_a_gang_of_min_replicas_and_every_worker_names_it() -> None:
    d = round_of(GANG_ON)
    assert d.status.placement == "Gang"
    (workload,) = created(d, "Workload", gang.API_VERSION)
    assert workload["metadata"]["name"] == "train-gang"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert workload["spec"]["podGroups"] == [
        {"name": "workers", "policy": {"gang": {"minCount": 2}}}
    ]
    assert workload["spec"]["controllerRef"]["kind"] == models.KIND
    pods = created(d, "Pod")
    assert len(pods) == 3
    assert all(
        p["spec"]["workloadRef"] == {"name": "train-gang", "podGroup": "workers"} for p in pods
    )
    # the Workload is created before the pods that name it
    kinds = [o["kind"] for o in d.create]
    assert kinds.index("Workload") < kinds.index("Pod")


def test_without_the_gang_no_workload_and_no_workload_ref() -> None:
    d = round_of(Config())
    assert d.status.placement == "OneByOne"
    assert not created(d, "Workload")
    assert all("workloadRef" not in p["spec"] for p in created(d, "Pod"))


def test_a_job_that_already_has_pods_and_no_record_stays_one_by_one() -> None:
    """Its pods have no workloadRef: a gang would never count them, and a replacement
    that named it would wait for ever."""
    pod = ObservedPod(name=builders.worker_pod_name("train", 0), index=0, phase="Running")
    status = models.ElasticJobStatus(desired_replicas=3)
    d = round_of(GANG_ON, status, Observed(pods=(pod,)))
    assert d.status.placement == "OneByOne"
    assert not created(d, "Workload")
    assert created(d, "Pod") and all("workloadRef" not in p["spec"] for p in created(d, "Pod"))


def merged(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``target`` after the API server applies the merge patch ``patch`` (RFC 7386)."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def test_the_placement_is_written_before_the_pods_that_embody_it() -> None:
    """kube.apply sends status_first before any child: a job whose pods exist already
    says how they are placed (on kind a test once read {} between the pods and the
    round's status), and the write is the operator's own echo, not a new round."""
    from elasticjob_operator.handlers import is_own_status_echo

    d = round_of(GANG_ON)
    assert created(d, "Pod")
    assert d.status_first == {"placement": "Gang", "observedGeneration": 1}
    echo = {"metadata": {"generation": 1}, "status": d.status_first}
    assert is_own_status_echo("MODIFIED", echo)
    # recorded: nothing is written first any more
    status = models.ElasticJobStatus.model_validate(d.status_first)
    assert round_of(GANG_ON, status).status_first == {}
    # a round that creates no pod leaves it to its status (a queued job: its Workload)
    queued = round_of(Config(kueue=True, gang=True), queue="team-a")
    assert not created(queued, "Pod") and queued.status_first == {}


def test_a_first_round_stopped_by_a_refused_pod_keeps_its_gang() -> None:
    """Pods 0 and 1 are created with the gang's workloadRef, pod 2 is refused (a quota):
    the round writes its previous status and the refusal (refusals.refused). The next
    round must still gang: a pod 2 without the workloadRef would leave the other two
    waiting for a gang of 3 that never forms."""
    first = round_of(GANG_ON)
    server = merged({}, first.status_first)
    event = refusals.refusal_event("Pod", "train-worker-2", "exceeded quota")
    refused = refusals.refused(models.ElasticJobStatus(), event, T0).status
    written = refused.model_dump(mode="json", by_alias=True, exclude_none=True)
    server = merged(server, merge_patch({}, written))  # the job's status was {} when read
    status = models.ElasticJobStatus.model_validate(server)
    assert status.placement == "Gang"
    pods = tuple(
        ObservedPod(name=builders.worker_pod_name("train", i), index=i, phase="Pending")
        for i in range(2)
    )
    observed = Observed(pods=pods, gang_workload=True, gang_min_count=2)
    d = round_of(GANG_ON, status, observed)
    assert d.status.placement == "Gang"
    (again,) = created(d, "Pod")
    assert again["metadata"]["name"] == "train-worker-2"
    assert again["spec"]["workloadRef"] == {"name": "train-gang", "podGroup": "workers"}


def test_the_recorded_placement_holds_whatever_the_operator_is_told_later() -> None:
    status = models.ElasticJobStatus(placement="Gang", desired_replicas=3)
    pods = tuple(
        ObservedPod(name=builders.worker_pod_name("train", i), index=i, phase="Running")
        for i in range(2)
    )
    observed = Observed(pods=pods, gang_workload=True, gang_min_count=2)
    d = round_of(GANG_ON, status, observed)
    assert not created(d, "Workload")  # it is there, with the right count
    (replacement,) = created(d, "Pod")
    assert replacement["spec"]["workloadRef"]["name"] == "train-gang"
    # the cluster no longer serves the API: nothing is created that it would refuse
    d = round_of(Config(), status, Observed(pods=pods))
    assert d.status.placement == "Gang"
    assert not created(d, "Workload")
    assert all("workloadRef" not in p["spec"] for p in created(d, "Pod"))


def test_a_changed_min_replicas_replaces_the_workload() -> None:
    status = models.ElasticJobStatus(placement="Gang", desired_replicas=3)
    observed = Observed(gang_workload=True, gang_min_count=2)
    d = round_of(GANG_ON, status, observed, spec(min_replicas=3))
    assert ChildRef("GangWorkload", "train-gang") in d.delete
    (workload,) = created(d, "Workload", gang.API_VERSION)
    assert workload["spec"]["podGroups"][0]["policy"]["gang"]["minCount"] == 3


def test_a_queued_job_says_both_and_makes_no_gang_before_admission() -> None:
    d = round_of(Config(kueue=True, gang=True), queue="team-a")
    assert d.status.placement == "Kueue+Gang"
    assert not created(d, "Pod")
    assert not created(d, "Workload", gang.API_VERSION)


@pytest.mark.parametrize(
    ("recorded", "queued", "on", "has_pods", "want"),
    [
        (None, False, False, False, "OneByOne"),
        (None, False, True, False, "Gang"),
        (None, True, False, False, "Kueue"),
        (None, True, True, False, "Kueue+Gang"),
        (None, True, True, True, "Kueue"),
        ("Gang", False, False, True, "Gang"),
    ],
)
def test_placement_of(
    recorded: str | None, queued: bool, on: bool, has_pods: bool, want: str
) -> None:
    assert gang.placement_of(recorded, queued, on, has_pods) == want


def test_in_use_needs_both_the_record_and_the_api() -> None:
    assert gang.in_use("Kueue+Gang", True)
    assert not gang.in_use("Kueue+Gang", False)
    assert not gang.in_use("Kueue", True)
    assert not gang.in_use(None, True)


def test_min_count_is_read_back_from_the_workload() -> None:
    assert gang.min_count_of(gang.workload(REF, 5)) == 5
    assert gang.min_count_of({"spec": {"podGroups": [{"name": "other"}]}}) is None
    assert gang.min_count_of({}) is None


@pytest.mark.parametrize(
    ("raw", "mode"), [("", gang.Mode.AUTO), ("auto", gang.Mode.AUTO), ("TRUE", gang.Mode.ON)]
)
def test_the_chart_value_is_read(raw: str, mode: gang.Mode) -> None:
    assert from_env({gang.ENV: raw, "ELASTICJOB_NETWORK_POLICY": "false"}).gang_mode is mode


def test_a_bad_chart_value_stops_the_operator_naming_it() -> None:
    with pytest.raises(SystemExit, match="ELASTICJOB_GANG_SCHEDULING='yes': set it to auto"):
        from_env({gang.ENV: "yes", "ELASTICJOB_NETWORK_POLICY": "false"})


def test_required_but_not_served_says_which_gates_to_enable() -> None:
    assert gang.enabled(gang.Mode.AUTO, served=True)
    assert not gang.enabled(gang.Mode.AUTO, served=False)
    assert not gang.enabled(gang.Mode.OFF, served=True)
    with pytest.raises(ValueError, match="GenericWorkload=true,GangScheduling=true"):
        gang.enabled(gang.Mode.ON, served=False)


def test_the_two_workload_kinds_go_to_their_own_apis() -> None:
    gang_workload = gang.workload(REF, 2)
    assert RESOURCES[resource_key(gang_workload)] == ("scheduling.k8s.io/v1alpha1", "workloads")
    kueue_workload = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload"}
    assert RESOURCES[resource_key(kueue_workload)] == ("kueue.x-k8s.io/v1beta2", "workloads")
