"""What a training job survives that is not the job's own: the operator killed, the API
server restarted, a pod's network cut for a while.

Each test trains the shipped example (examples/manifests/elastic.yaml, two workers) and
breaks something under it, then checks what a user would: training never stopped (the
rank-0 step lines kept coming, with no restart or regroup), the pods are exactly the ones
there were (no duplicate, no orphan, one etcd), and the job's status caught up with what
runs. The API-server and network faults run on the devcluster and on kind
(cluster_faults.py).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_faults import E2E_NODES, cluster_faults
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
    Logs,
    Step,
    delete_jobs,
    job_starter,
    manifest,
    unique,
    wait_step,
)

from elasticjob_devcluster import faults, procs
from elasticjob_devcluster.controlplane import APISERVER, DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TAIL = int(os.environ.get("ELASTICJOB_E2E_LOG_TAIL", "60"))  # lines shown after a test
CATCH_UP = 60.0  # the operator's status follows the job again within this (resync 2 s)


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path) -> Cluster:
    return Cluster(kubeconfig)


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Operator]:
    with installed_operator(cluster, "if") as op:
        yield op


@pytest.fixture
def ns(installed: Operator) -> Iterator[str]:
    """The watched namespace; a test's jobs are deleted after it, freeing the cores."""
    yield installed.job_namespace
    delete_jobs(installed.cluster, installed.job_namespace)


@pytest.fixture
def start(cluster: Cluster, ns: str) -> Iterator[Callable[[Obj], Logs]]:
    """Apply a job and follow its workers' logs; the followers stop after the test."""
    with job_starter(cluster, ns, TAIL) as start_job:
        yield start_job


def node_ready(c: Cluster, node: str) -> bool:
    conditions = c.core.read_node(node).status.conditions or []
    return [x.status for x in conditions if x.type == "Ready"] == ["True"]


def needs_devcluster(devcluster: DevCluster | None) -> DevCluster:
    if devcluster is None:
        pytest.skip("this fault needs the devcluster")
    return devcluster


def long_job(name: str) -> Obj:
    """Two workers that train until the test deletes the job, a step line every 2 steps."""
    return manifest(
        name, TRAIN_STEPS=100000, TRAIN_SLEEP=0.1, TRAIN_LOG_EVERY=2, TRAIN_CHECKPOINT_INTERVAL=10
    )


def children(c: Cluster, ns: str, name: str) -> dict[str, list[str]]:
    """The job's live pods by role: names with uids, so a replaced pod shows."""
    found: dict[str, list[str]] = {"worker": [], "etcd": []}
    for pod in c.core.list_namespaced_pod(ns, label_selector=f"{JOB_LABEL}={name}").items:
        role = pod.metadata.labels.get(ROLE_LABEL, "?")
        found.setdefault(role, []).append(f"{pod.metadata.name}/{pod.metadata.uid}")
    return {role: sorted(pods) for role, pods in found.items()}


def settled(c: Cluster, ns: str, name: str, workers: int, after_step: int) -> Obj | None:
    """The status once it reflects a job training at full size past ``after_step``."""
    status = c.status(ns, name)
    conditions = {x["type"]: x for x in status.get("conditions", [])}
    running = conditions.get("Running", {})
    step = (status.get("progress") or {}).get("step", 0)
    full = running.get("status") == "True" and f"{workers} of {workers}" in running.get(
        "message", ""
    )
    return status if full and step > after_step else None


def steps_between(logs: Logs, start: float, end: float) -> list[Step]:
    return [s for s in logs.steps() if start < s.t < end]


def assert_trained_through(logs: Logs, since: float, until: float) -> None:
    """Training never stopped: no worker (re)started or regrouped since ``since``, and
    steps were logged all along (no gap longer than a few seconds) until ``until``."""
    assert not [r for r in logs.resumes() if r.t > since], logs.tail()
    times = [since, *(s.t for s in steps_between(logs, since, until)), until]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 15.0, f"training paused {max(gaps):.1f}s\n{logs.tail()}"


def test_restart_apiserver_keeps_the_clusters_state_and_its_process_records(
    cluster: Cluster, devcluster: DevCluster | None, ns: str
) -> None:
    """``DevCluster.restart_apiserver``: a new process with the same arguments (the
    record swapped in place, so ``down`` stops it), the same objects behind it, and the
    node agents and controller-manager talking to it again."""
    dev = needs_devcluster(devcluster)
    c = cluster
    sleeper: Obj = {
        "metadata": {"name": "before"},
        "spec": {
            "securityContext": RESTRICTED_POD,  # the job namespace enforces it
            "containers": [
                {
                    "name": "main",
                    "image": RUNTIME_IMAGE,
                    "command": ["sleep", "3600"],
                    "securityContext": RESTRICTED_CONTAINER,
                },
            ],
        },
    }
    c.core.create_namespaced_pod(ns, sleeper)
    wait_for(
        "the pod to run",
        lambda: c.core.read_namespaced_pod("before", ns).status.phase == "Running",
    )
    uid = c.core.read_namespaced_pod("before", ns).metadata.uid
    names = [r.name for r in dev.records()]
    (old,) = [r for r in dev.records() if r.name == APISERVER]

    dev.restart_apiserver()

    (new,) = [r for r in dev.records() if r.name == APISERVER]
    assert new.pid != old.pid and not procs.is_alive(old) and procs.is_alive(new)
    assert [r.name for r in dev.records()] == names  # same place: down's order holds
    assert dev.is_running()
    pod = c.core.read_namespaced_pod("before", ns)
    assert pod.metadata.uid == uid and pod.status.phase == "Running"
    # the agents' watches and the binder work again: a new pod is scheduled and runs
    c.core.create_namespaced_pod(ns, {**sleeper, "metadata": {"name": "after"}})
    wait_for(
        "a pod created after the restart to run",
        lambda: c.core.read_namespaced_pod("after", ns).status.phase == "Running",
    )
    for name in ("before", "after"):
        c.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    wait_for("the pods to be gone", lambda: not c.core.list_namespaced_pod(ns).items)


def test_a_killed_operator_stops_no_training_duplicates_no_pod_and_its_status_catches_up(
    cluster: Cluster, devcluster: DevCluster | None, installed: Operator, ns: str, start: Any
) -> None:
    """SIGKILL the operator (no cleanup, as an OOM kill or a crash) while a job trains: the
    workers never notice, the restarted operator adopts what runs instead of creating it
    again, and the status follows the training within a couple of resyncs."""
    c = cluster
    name = unique("opkill")
    logs = start(long_job(name))
    wait_step(logs, 6, world=2)
    before = wait_for("the status to settle", lambda: settled(c, ns, name, 2, 0), TRAIN)
    kids = children(c, ns, name)
    assert len(kids["worker"]) == 2 and len(kids["etcd"]) == 1, kids

    (op_pod,) = installed.pods(running=True)
    restarts = op_pod.status.container_statuses[0].restart_count
    killed_at = time.time()
    if devcluster is not None:
        faults.kill_container(devcluster.dir, installed.namespace, op_pod.metadata.name)
    else:  # elsewhere: the pod goes at once and the Deployment makes another
        c.kubectl(
            "-n",
            installed.namespace,
            "delete",
            "pod",
            op_pod.metadata.name,
            "--grace-period=0",
            "--force",
        )

    def operator_back() -> bool:
        pods = installed.pods(running=True)
        if devcluster is None:
            return any(p.metadata.uid != op_pod.metadata.uid for p in pods)
        return any(
            s.restart_count > restarts and s.ready
            for p in pods
            for s in p.status.container_statuses or []
        )

    wait_for("the operator to run again", operator_back, TRAIN)
    back_at = time.time()
    at_back = wait_step(logs, logs.last_step())  # the step training had reached meanwhile
    status = wait_for(
        "the status to catch up with training",
        lambda: settled(c, ns, name, 2, at_back.step),
        CATCH_UP,
    )
    assert_trained_through(logs, killed_at, back_at)
    assert children(c, ns, name) == kids  # the very same pods: none added, none replaced
    for key in ("restartCount", "incarnation", "startTime"):
        assert status.get(key) == before.get(key), key


def test_an_api_server_restart_stops_no_training_and_everyone_reconnects(
    cluster: Cluster, devcluster: DevCluster | None, ns: str, start: Any
) -> None:
    """The workers meet in the job's own etcd, so an API-server restart does not touch
    training; the node agents, the controller-manager and the operator reconnect, which a
    scale-up afterwards proves (the operator creates the pod, an agent binds and runs it)."""
    broken = cluster_faults(cluster, devcluster, E2E_NODES)
    c = cluster
    name = unique("apirestart")
    logs = start(long_job(name))
    wait_step(logs, 6, world=2)
    before = wait_for("the status to settle", lambda: settled(c, ns, name, 2, 0), TRAIN)
    kids = children(c, ns, name)
    assert len(kids["worker"]) == 2 and len(kids["etcd"]) == 1, kids

    stopped_at = time.time()
    broken.restart_apiserver()
    back_at = time.time()
    at_back = wait_step(logs, logs.last_step())
    status = wait_for(
        "the status to catch up with training",
        lambda: settled(c, ns, name, 2, at_back.step),
        CATCH_UP,
    )
    # the logs of the outage arrive once the followers are back: wait for a later step
    wait_step(logs, at_back.step + 4)
    assert_trained_through(logs, stopped_at, back_at)
    assert children(c, ns, name) == kids
    for key in ("restartCount", "incarnation", "startTime"):
        assert status.get(key) == before.get(key), key
    for node in broken.nodes:  # the session's (tests elsewhere lose nodes of their own)
        # The node controller may have marked a node Unknown while its agent could not
        # post (the outage outlived the lease grace on a busy machine): it reconnects,
        # posts, and the node is Ready again.
        wait_for(f"node {node} Ready again", lambda n=node: node_ready(c, n), CATCH_UP)

    scaled_at = time.time()
    c.kubectl("-n", ns, "scale", f"elasticjob/{name}", "--replicas=3")
    wait_for(
        "the group to grow to 3 after the restart",
        lambda: any(s.t > scaled_at and s.world == 3 for s in logs.steps()),
        TRAIN,
    )


def test_a_pod_cut_off_for_10s_comes_back_and_the_job_trains_at_full_size(
    cluster: Cluster, devcluster: DevCluster | None, ns: str, start: Any
) -> None:
    """A worker's network goes down for 10 s (both ends of its link, so etcd, its peers
    and the API server are all out of reach): its lease runs out and the survivor trains
    on alone; once the link is back the cut worker's agent, which kept retrying etcd,
    rejoins by itself (the same pod, nothing replaced) and the job trains at full size
    again."""
    broken = cluster_faults(cluster, devcluster, E2E_NODES)
    c = cluster
    name = unique("cut")
    logs = start(long_job(name))
    wait_step(logs, 6, world=2)
    pod = f"{name}-worker-1"
    uid = c.core.read_namespaced_pod(pod, ns).metadata.uid
    restarts = c.status(ns, name).get("restartCount", 0)
    cut_at = time.time()
    broken.cut_network(ns, pod)
    try:
        alone = wait_for(
            "the survivor to train alone",
            lambda: next((s for s in steps_between(logs, cut_at, 1e12) if s.world == 1), None),
            30,
        )
        time.sleep(max(0.0, cut_at + 10 - time.time()))
    finally:
        broken.restore_network(ns, pod)
    restored_at = time.time()
    back = wait_for(
        "the job to train at world 2 again",
        lambda: next((s for s in steps_between(logs, restored_at, 1e12) if s.world == 2), None),
        TRAIN,
    )
    assert back.step > alone.step
    wait_step(logs, back.step + 10, world=2)  # and on
    # it rejoined: the same pod, its agent regrouped in place, nothing replaced
    workers = c.running_workers(ns, name)
    assert sorted(workers) == [f"{name}-worker-0", pod], sorted(workers)
    assert workers[pod].metadata.uid == uid
    status = wait_for(
        "the status to show 2 of 2 training",
        lambda: settled(c, ns, name, 2, back.step),
        CATCH_UP,
    )
    assert status.get("restartCount", 0) == restarts
