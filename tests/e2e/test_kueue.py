"""ElasticJobs under the real Kueue: admission before any worker exists, partial admission,
preemption by a higher-priority job and re-admission with every sample seen once.

Kueue (the pinned release, built by the bootstrap) runs beside the devcluster's control
plane (elasticjob_devcluster.kueue); the operator is installed with helm and
``kueue.enabled=true``. Each test makes its own ResourceFlavor, ClusterQueue (quota for
three workers of the example, 100m CPU each) and LocalQueue, and checks what a user sees:
pods, the job's status and events, the example's own log lines.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from elasticjob_examples import sample_audit
from goodput_checks import assert_goodput_agrees
from kube_helpers import (
    Cluster,
    Obj,
    Operator,
    delete_shared_volumes,
    installed_operator,
    shared_claim,
    wait_for,
)
from training_logs import TRAIN, delete_jobs, job_starter, manifest, unique, wait_step

from elasticjob_devcluster.controlplane import DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KUEUE = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
SUFFIX = uuid.uuid4().hex[:6]
WORKER_CPU = "100m"  # what training_logs.manifest requests per worker


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path, devcluster: DevCluster | None) -> Cluster:
    if devcluster is not None:
        devcluster.start_kueue()
    c = Cluster(kubeconfig)
    served = c.kubectl("get", "crd", "workloads.kueue.x-k8s.io", check=False)
    if served.returncode != 0:
        pytest.skip(
            "this cluster has no Kueue (make kind-e2e installs it; the devcluster starts it)"
        )
    return c


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Operator]:
    with installed_operator(cluster, "ku", "--set", "kueue.enabled=true") as op:
        yield op


def apply_cluster_object(c: Cluster, obj: Obj) -> None:
    c.kubectl("apply", "-f", "-", input=json.dumps(obj))


@pytest.fixture(scope="module")
def queue(installed: Operator) -> Iterator[str]:
    """A LocalQueue in the job namespace, on a ClusterQueue with quota for 3 workers that
    preempts lower priorities; the name of the LocalQueue."""
    c, ns = installed.cluster, installed.job_namespace
    flavor, cq, lq = f"ku-flavor-{SUFFIX}", f"ku-cq-{SUFFIX}", "training"
    apply_cluster_object(
        c, {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": flavor}}
    )
    apply_cluster_object(
        c,
        {
            "apiVersion": KUEUE,
            "kind": "ClusterQueue",
            "metadata": {"name": cq},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory"],
                        "flavors": [
                            {
                                "name": flavor,
                                "resources": [
                                    {"name": "cpu", "nominalQuota": "300m"},
                                    {"name": "memory", "nominalQuota": "64Gi"},
                                ],
                            }
                        ],
                    }
                ],
            },
        },
    )
    c.apply(
        ns,
        {
            "apiVersion": KUEUE,
            "kind": "LocalQueue",
            "metadata": {"name": lq},
            "spec": {"clusterQueue": cq},
        },
    )
    apply_cluster_object(
        c,
        {
            "apiVersion": KUEUE,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": f"ku-urgent-{SUFFIX}"},
            "value": 1000,
        },
    )
    wait_for(
        "the ClusterQueue to be active",
        lambda: any(
            x.get("type") == "Active" and x.get("status") == "True"
            for x in (
                c.custom.get_cluster_custom_object(
                    "kueue.x-k8s.io", "v1beta2", "clusterqueues", cq
                ).get("status")
                or {}
            ).get("conditions", [])
        ),
    )
    try:
        yield lq
    finally:
        delete_jobs(c, ns)
        delete_shared_volumes(c, ns)
        c.kubectl("-n", ns, "delete", "localqueue", lq, "--wait=false", check=False)
        for kind, name in (
            ("clusterqueue", cq),
            ("resourceflavor", flavor),
            ("workloadpriorityclass", f"ku-urgent-{SUFFIX}"),
        ):
            c.kubectl("delete", kind, name, "--wait=false", check=False)


@pytest.fixture(autouse=True)
def one_test_at_a_time(installed: Operator) -> Iterator[None]:
    """Each test starts with the queue's quota free: the jobs it started are deleted
    after it, and their pods (and so their Workloads) gone."""
    yield
    delete_jobs(installed.cluster, installed.job_namespace)
    wait_for(
        "the jobs' Workloads to be gone",
        lambda: (
            not installed.cluster.custom.list_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", installed.job_namespace, "workloads"
            )["items"]
        ),
    )


def queued(doc: Obj, queue: str, priority: str | None = None) -> Obj:
    labels = {QUEUE_LABEL: queue}
    if priority is not None:
        labels[PRIORITY_LABEL] = priority
    doc["metadata"]["labels"] = labels
    return doc


def queue_cq(installed: Operator) -> str:
    return f"ku-cq-{SUFFIX}"


def set_cpu_quota(c: Cluster, cluster_queue: str, cpu: str) -> None:
    path = "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota"
    c.kubectl(
        "patch",
        "clusterqueue",
        cluster_queue,
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": path, "value": cpu}]),
    )


def conditions(c: Cluster, ns: str, name: str) -> dict[str, Obj]:
    return {x["type"]: x for x in c.status(ns, name).get("conditions", [])}


def workers(c: Cluster, ns: str, name: str) -> list[str]:
    return sorted(c.workers(ns, name))


def test_a_job_without_quota_creates_no_worker_until_kueue_admits_it_then_runs_what_was_admitted(
    installed: Operator, queue: str
) -> None:
    c, ns = installed.cluster, installed.job_namespace
    with job_starter(c, ns) as start:
        first = unique("first")
        start(queued(manifest(first, replicas=3, TRAIN_STEPS=100000, TRAIN_SLEEP=0.2), queue))
        wait_for(
            "3 running workers of the first job", lambda: len(c.running_workers(ns, first)) == 3
        )
        # the status is the operator's next write: it may trail the pods it created
        wait_for(
            "the first job's status to say 3 admitted",
            lambda: c.status(ns, first).get("admittedReplicas") == 3,
        )

        second = unique("second")
        logs = start(
            queued(manifest(second, replicas=4, TRAIN_STEPS=100000, TRAIN_SLEEP=0.2), queue)
        )
        wait_for(
            "the second job to wait in its queue, saying why",
            lambda: (
                conditions(c, ns, second).get("Queued", {}).get("status") == "True"
                and "insufficient" in conditions(c, ns, second)["Queued"].get("message", "")
            ),
        )
        assert c.status(ns, second)["phase"] == "Queued"
        assert workers(c, ns, second) == []  # nothing holds part of the cluster while it waits
        table = c.kubectl("-n", ns, "get", "elasticjob", second, "-o", "wide").stdout
        assert "ADMITTED" in table and "Queued" in table

        c.kubectl("-n", ns, "delete", "elasticjob", first, "--wait=false")
        # quota for 3 of the 4 it wants (minReplicas 1): Kueue admits 3, and 3 train
        three = wait_step(logs, 3, world=3)
        status = c.status(ns, second)
        assert status["admittedReplicas"] == 3
        assert "3 of 4 workers" in conditions(c, ns, second)["Admitted"]["message"]
        assert workers(c, ns, second) == [f"{second}-worker-{i}" for i in range(3)]
        assert "Admitted" in c.events(ns, second)

        # quota for the 4th frees (the admin raises it): the worker the partial admission
        # left out starts and joins the running group
        set_cpu_quota(c, queue_cq(installed), "400m")
        try:
            wait_step(logs, three.step + 1, world=4)
            assert c.status(ns, second)["admittedReplicas"] == 4
        finally:
            set_cpu_quota(c, queue_cq(installed), "300m")


def on_claim(doc: Obj, claim: str) -> Obj:
    """The job's checkpoints on a claim that outlives its pods (a suspension deletes them)."""
    spec = doc["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    spec["volumes"] = [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}}]
    return doc


def attempts(records: list[sample_audit.Record]) -> dict[int, int]:
    """Per step, how many times it was trained and committed."""
    return {step: len(tries) for step, tries in sample_audit.committed_attempts(records).items()}


def test_a_preempted_job_saves_waits_and_resumes_with_every_sample_once(
    installed: Operator, queue: str
) -> None:
    c, ns = installed.cluster, installed.job_namespace
    # Kueue preempts within a second of the urgent job's creation (step ~22); the low job
    # then trains at 1 (its partial admission) for the urgent job's ~10 s, about 70 steps,
    # and at 3 once that is done. 240 steps only added 12 s of training at 3 after that.
    samples, batch, steps = 1536, 32, 160
    with job_starter(c, ns) as start:
        low = unique("low")
        shared_claim(c, ns, f"{low}-ckpt")
        before_apply = time.time()
        logs = start(
            on_claim(
                queued(
                    manifest(
                        low,
                        replicas=3,
                        TRAIN_STEPS=steps,
                        TRAIN_SAMPLES=samples,
                        TRAIN_BATCH_SIZE=batch,
                        TRAIN_SLEEP=0.15,
                        TRAIN_LOG_EVERY=1,  # every step: goodput_checks reads them
                        TRAIN_CHECKPOINT_INTERVAL=1000,  # only the save at preemption
                        TRAIN_LOG_SAMPLES=1,
                    ),
                    queue,
                ),
                f"{low}-ckpt",
            )
        )
        applied = (before_apply, time.time())  # the creation is in between
        before = wait_step(logs, 20, world=3)

        high = unique("high")
        start(
            queued(
                manifest(high, replicas=2, TRAIN_STEPS=30, TRAIN_SLEEP=0.05),
                queue,
                priority=f"ku-urgent-{SUFFIX}",
            )
        )
        wait_for(
            "the low job to be evicted and wait in its queue",
            lambda: (
                conditions(c, ns, low).get("Queued", {}).get("status") == "True"
                and not workers(c, ns, low)
            ),
            timeout=TRAIN,
        )
        evicted = time.time()
        assert "Preempted" in conditions(c, ns, low)["Queued"]["reason"]
        waited = c.kubectl(
            "-n", ns, "wait", f"elasticjob/{high}", "--for=condition=Succeeded", "--timeout=280s"
        )
        assert waited.returncode == 0
        waited = c.kubectl(
            "-n", ns, "wait", f"elasticjob/{low}", "--for=condition=Succeeded", "--timeout=280s"
        )
        assert waited.returncode == 0, logs.tail()

    status = c.status(ns, low)
    assert status["restartCount"] == 0 and status["replicaStatuses"]["Worker"]["failed"] == 0
    assert status["incarnation"] == 1  # one new run, after the re-admission
    records = logs.samples()
    found = sample_audit.audit(records, samples, steps)
    assert not found.problems, found.problems
    redone = {s: n for s, n in attempts(records).items() if n > 1}
    assert not redone, f"steps trained twice across the preemption: {sorted(redone)[:10]}"
    resumed = [r for r in logs.resumes() if r.t > before.t and r.step > 0]
    assert resumed, f"the low job did not resume from a saved step:\n{logs.tail()}"
    # its goodput spans both runs: the preemption is waiting, on the timeline as a
    # suspension around the moment the test saw the job evicted, and every second since
    # the apply is in one bucket
    goodput = status["goodput"]
    assert goodput["runs"] == 2 and goodput["earlier"]["runs"] == 1, goodput
    assert_goodput_agrees(goodput, applied, logs.steps())
    suspended = [m for m in goodput["timeline"] if m["cause"] == "suspended"]
    assert len(suspended) == 1, goodput["timeline"]
    since, until = (datetime.fromisoformat(suspended[0][k]).timestamp() for k in ("since", "time"))
    # The test sees the job evicted once its pods are terminating; their workers save and
    # publish their ledger a moment later (0.04 s in one run): the last entry may follow.
    assert since <= evicted + 2.0 and evicted <= until, (since, evicted, until)
    assert goodput["waitingSeconds"] >= suspended[0]["pauseSeconds"] > 0
