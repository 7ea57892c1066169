"""What the real kube-scheduler does to ElasticJobs: gang placement (at least minReplicas
workers bound together, or none of them) and preemption (the preempted worker hands over,
no step is trained twice, nothing is charged to backoffLimit).

kind only (``make kind-e2e`` starts the cluster with the feature gates GenericWorkload and
GangScheduling and the scheduling.k8s.io/v1alpha1 API): the devcluster places pods with
its own binder, which is not kube-scheduler. Each worker node gets one slot of an extended
resource and every worker asks for one, so the cluster holds exactly two workers: a gang
of three cannot be placed (without the gang two of its three would be bound and hold both
nodes while the third waits), and a pod of a higher priority that asks for a slot
preempts a worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from elasticjob_examples import sample_audit
from kube_helpers import (
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    RUNTIME_IMAGE,
    Cluster,
    Obj,
    Operator,
    installed_operator,
    wait_for,
)
from training_logs import (
    JOB_LABEL,
    ROLE_LABEL,
    TRAIN,
    delete_jobs,
    job_starter,
    manifest,
    unique,
    wait_step,
    wait_world,
)

from elasticjob_devcluster.controlplane import DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SLOT = "elasticjob.dev/e2e-slot"
SLOT_PATH = "/status/capacity/" + SLOT.replace("/", "~1")
HOLD_S = 30.0  # how long a gang that cannot be placed is watched for a bound pod


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path, devcluster: DevCluster | None) -> Cluster:
    if devcluster is not None:
        pytest.skip("the devcluster binds pods with its own binder, not kube-scheduler (kind)")
    c = Cluster(kubeconfig)
    served = c.kubectl("get", "--raw", "/apis/scheduling.k8s.io/v1alpha1", check=False)
    if served.returncode != 0 or '"workloads"' not in served.stdout:
        pytest.skip("this cluster does not serve scheduling.k8s.io/v1alpha1 Workloads")
    return c


def worker_nodes(c: Cluster) -> list[str]:
    return sorted(
        n.metadata.name
        for n in c.core.list_node().items
        if "node-role.kubernetes.io/control-plane" not in (n.metadata.labels or {})
    )


def patch_capacity(c: Cluster, node: str, op: str) -> None:
    change: Obj = {"op": op, "path": SLOT_PATH}
    if op == "add":
        change["value"] = "1"
    c.kubectl(
        "patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps([change])
    )


@pytest.fixture(scope="module")
def slots(cluster: Cluster) -> Iterator[list[str]]:
    """One slot on each worker node (removed afterwards); the nodes' names."""
    nodes = worker_nodes(cluster)
    assert len(nodes) == 2, f"kind-e2e makes two worker nodes, found {nodes}"
    try:
        for node in nodes:
            patch_capacity(cluster, node, "add")
        wait_for(
            "the slots to be allocatable",
            lambda: all(
                (cluster.core.read_node(n).status.allocatable or {}).get(SLOT) == "1" for n in nodes
            ),
        )
        yield nodes
    finally:
        for node in nodes:
            patch_capacity(cluster, node, "remove")


@pytest.fixture(scope="module")
def installed(cluster: Cluster, slots: list[str]) -> Iterator[Operator]:
    with installed_operator(cluster, "gang") as op:  # gangScheduling.enabled: auto
        yield op


@pytest.fixture(autouse=True)
def one_job_at_a_time(installed: Operator) -> Iterator[None]:
    """Each test starts with both slots free: the jobs it started are gone after it."""
    yield
    delete_jobs(installed.cluster, installed.job_namespace)


def gang_job(name: str, min_replicas: int, replicas: int, **env: object) -> Obj:
    doc = manifest(name, replicas=replicas, **{"TRAIN_STEPS": 100000, "TRAIN_SLEEP": 0.2, **env})
    doc["spec"]["minReplicas"] = min_replicas
    doc["spec"]["maxReplicas"] = 3
    container = doc["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["resources"]["requests"][SLOT] = "1"
    container["resources"]["limits"] = {SLOT: "1"}
    return doc


def gang_workload(c: Cluster, ns: str, job: str) -> Obj:
    got: Obj = c.custom.get_namespaced_custom_object(
        "scheduling.k8s.io", "v1alpha1", ns, "workloads", f"{job}-gang"
    )
    return got


def bound(c: Cluster, ns: str, job: str) -> dict[str, str]:
    """The job's worker pods that have a node: name -> node."""
    return {n: p.spec.node_name for n, p in c.workers(ns, job).items() if p.spec.node_name}


def test_a_gang_the_cluster_cannot_hold_binds_no_worker_at_all(installed: Operator) -> None:
    c, ns = installed.cluster, installed.job_namespace
    name = unique("whole")
    c.apply(ns, gang_job(name, min_replicas=3, replicas=3))
    wait_for("3 worker pods", lambda: len(c.workers(ns, name)) == 3)
    # written before the first pod (Decision.status_first), not with the round's status
    # after them: one read, however slow the API server
    assert c.status(ns, name).get("placement") == "Gang"
    groups = gang_workload(c, ns, name)["spec"]["podGroups"]
    assert groups == [{"name": "workers", "policy": {"gang": {"minCount": 3}}}]
    # as JSON: the kubernetes client's V1PodSpec has no workloadRef yet
    workers = f"{JOB_LABEL}={name},{ROLE_LABEL}=worker"
    pods = json.loads(c.kubectl("-n", ns, "get", "pods", "-l", workers, "-o", "json").stdout)
    refs = [p["spec"].get("workloadRef") for p in pods["items"]]
    assert refs == [{"name": f"{name}-gang", "podGroup": "workers"}] * 3, refs
    wide = c.kubectl("-n", ns, "get", "elasticjob", name, "-o", "wide").stdout
    assert "Gang" in wide, wide
    # two of the three fit; without the gang they are bound within seconds
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        assert not bound(c, ns, name), (
            f"a worker of a gang of 3 was bound on 2 slots: {bound(c, ns, name)}"
        )
        time.sleep(1.0)


def test_a_gang_of_min_replicas_is_placed_together_and_trains(installed: Operator) -> None:
    c, ns = installed.cluster, installed.job_namespace
    with job_starter(c, ns) as start:
        name = unique("two")
        logs = start(gang_job(name, min_replicas=2, replicas=3))
        wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2, TRAIN)
        placed = bound(c, ns, name)
        assert sorted(placed.values()) == worker_nodes(c), placed
        assert len(c.workers(ns, name)) == 3  # the third waits for a slot, unbound
        wait_step(logs, 20, world=2)
        assert gang_workload(c, ns, name)["spec"]["podGroups"][0]["policy"]["gang"] == {
            "minCount": 2
        }
        # a scale-down to what the cluster holds: the waiting worker goes, training goes on
        c.kubectl("-n", ns, "scale", "elasticjob", name, "--replicas=2")
        wait_for("the unbound worker to go", lambda: len(c.workers(ns, name)) == 2)
        reached = logs.last_step()
        wait_step(logs, reached + 10, world=2)


def preemptor(name: str, priority_class: str) -> Obj:
    """A plain pod of a higher priority that needs a slot: kube-scheduler must preempt."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "priorityClassName": priority_class,
            "terminationGracePeriodSeconds": 0,  # sleep ignores SIGTERM
            "securityContext": RESTRICTED_POD,
            "containers": [
                {
                    "name": "sleep",
                    "image": RUNTIME_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", "3600"],
                    "resources": {
                        "requests": {"cpu": "10m", "memory": "16Mi", SLOT: "1"},
                        "limits": {SLOT: "1"},
                    },
                    "securityContext": RESTRICTED_CONTAINER,
                }
            ],
        },
    }


def test_a_worker_kube_scheduler_preempts_hands_over_and_is_not_charged(
    installed: Operator,
) -> None:
    """A higher-priority pod takes a worker's slot: kube-scheduler marks the worker
    (DisruptionTarget, PreemptionByScheduler) and the kubelet sends SIGTERM. The worker
    hands over at a step boundary, its replacement waits for a slot, and joins when the
    preemptor goes. backoffLimit 0, and the job still succeeds with every sample once per
    epoch and no step trained twice."""
    c, ns = installed.cluster, installed.job_namespace
    high = f"{ns}-high"
    c.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": high},
                "value": 1000000,
            }
        ),
    )
    samples, steps = 2048, 600
    try:
        with job_starter(c, ns) as start:
            name = unique("preempted")
            doc = gang_job(
                name,
                min_replicas=1,
                replicas=2,
                TRAIN_STEPS=steps,
                TRAIN_SAMPLES=samples,
                TRAIN_BATCH_SIZE=32,
                TRAIN_SLEEP=0.1,
                TRAIN_LOG_EVERY=1,
                TRAIN_CHECKPOINT_INTERVAL=5,
                TRAIN_LOG_SAMPLES=1,
            )
            doc["spec"]["backoffLimit"] = 0
            logs = start(doc)
            wait_step(logs, 10, world=2)
            preempted_at = time.time()
            c.apply(ns, preemptor("preemptor", high))
            wait_for(
                "the preemptor to run",
                lambda: c.core.read_namespaced_pod("preemptor", ns).status.phase == "Running",
                TRAIN,
            )
            one = wait_world(logs, 1, preempted_at)
            text = "\n".join(logs.text())
            assert "announced this node's departure" in text, logs.tail()
            assert "abandon its collectives" not in text, logs.tail()
            (regroup,) = [r for r in logs.resumes() if preempted_at < r.t <= one.t]
            assert (regroup.world, one.step) == (1, regroup.step + 1), (regroup, one)
            # the replacement waits for a slot: Pending, unbound, the job carries on
            wait_for("the replacement worker", lambda: len(c.workers(ns, name)) == 2, TRAIN)
            assert len(bound(c, ns, name)) == 1, bound(c, ns, name)
            c.kubectl("-n", ns, "delete", "pod", "preemptor", "--wait=false")
            wait_world(logs, 2, one.t)
            waited = c.kubectl(
                "-n", ns, "wait", f"elasticjob/{name}", "--for=condition=Succeeded",
                "--timeout=600s",
            )  # fmt: skip
            assert waited.returncode == 0
            time.sleep(2)  # the followers read the last lines
            logged = [s.step for s in logs.steps()]
            assert len(logged) == len(set(logged)), "a step was trained twice"
            found = sample_audit.audit(logs.samples(), samples, steps)
            assert not found.problems, found.problems
            assert c.status(ns, name)["restartCount"] == 0, (c.status(ns, name), c.events(ns, name))
    finally:
        c.kubectl("-n", ns, "delete", "pod", "preemptor", "--wait=false", check=False)
        c.kubectl("delete", "priorityclass", high, "--wait=false", check=False)
