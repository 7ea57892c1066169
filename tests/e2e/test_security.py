"""What the operator does for a job's security, on a real API server: the NetworkPolicies
it renders (and the chart value that turns them off), restricted Pod Security for every
pod it makes (and a clear word when the API server refuses one), and RBAC that grants the
operator exactly what it uses, proven from the API server's audit log.

Every namespace here enforces the restricted Pod Security Standard (kube_helpers). The
devcluster's pod network does not enforce NetworkPolicy, so there these tests prove the
objects and their selectors; on a cluster whose network enforces them (``make kind-e2e``:
kube-router, ELASTICJOB_E2E_NETWORK_POLICY_ENFORCED=1) one more test proves they hold.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from elasticjob_manifests import job
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

from elasticjob_devcluster.controlplane import DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SLEEP = ["python", "-c", "import time\ntime.sleep(3600)\n"]
ENFORCED = os.environ.get("ELASTICJOB_E2E_NETWORK_POLICY_ENFORCED") == "1"
LISTEN_PORT = 8090
# A worker that listens, so that a connection to it can be refused or let through.
LISTEN = ["python", "-m", "http.server", str(LISTEN_PORT)]
# Opens a TCP connection to each of TARGETS (host:port ...), trying each for up to 30 s
# (a new pod's address reaches the policies' rules a moment after it starts, and a
# listener may still be starting), and prints one JSON line: target -> "open", or the
# last error.
CONNECT = [
    "python",
    "-c",
    "import json, os, socket, time\n"
    "seen = {}\n"
    "for target in os.environ['TARGETS'].split():\n"
    "    host, port = target.rsplit(':', 1)\n"
    "    deadline = time.monotonic() + 30\n"
    "    while seen.get(target) != 'open' and time.monotonic() < deadline:\n"
    "        try:\n"
    "            socket.create_connection((host, int(port)), timeout=3).close()\n"
    "            seen[target] = 'open'\n"
    "        except OSError as exc:\n"
    "            seen[target] = type(exc).__name__\n"
    "            time.sleep(0.5)\n"
    "print(json.dumps(seen), flush=True)\n",
]


def labels(job_name: str, role: str) -> dict[str, str]:
    return {"elastic.pytorch.org/job-name": job_name, "elastic.pytorch.org/replica-type": role}


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path) -> Cluster:
    return Cluster(kubeconfig)


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Operator]:
    with installed_operator(cluster, "sec") as op:
        yield op


def policies(c: Cluster, ns: str, name: str) -> dict[str, Obj]:
    """The job's NetworkPolicies by name, as plain dicts."""
    api = c.core.api_client
    from kubernetes import client

    items = (
        client.NetworkingV1Api(api)
        .list_namespaced_network_policy(ns, label_selector=f"elastic.pytorch.org/job-name={name}")
        .items
    )
    return {p.metadata.name: api.sanitize_for_serialization(p) for p in items}


def selected(c: Cluster, ns: str, match_labels: dict[str, str]) -> set[str]:
    selector = ",".join(f"{k}={v}" for k, v in match_labels.items())
    return {p.metadata.name for p in c.core.list_namespaced_pod(ns, label_selector=selector).items}


def test_a_job_gets_network_policies_selecting_its_workers_etcd_and_operator(
    installed: Operator,
) -> None:
    c, ns = installed.cluster, installed.job_namespace
    c.apply(ns, job("fenced", SLEEP, replicas=2))
    uid = c.job(ns, "fenced")["metadata"]["uid"]
    wait_for("2 running workers", lambda: len(c.running_workers(ns, "fenced")) == 2)
    found = wait_for("both policies", lambda: len(p := policies(c, ns, "fenced")) == 2 and p)
    worker, etcd = found["fenced-worker"], found["fenced-etcd"]
    for policy in (worker, etcd):
        assert policy["metadata"]["ownerReferences"][0]["uid"] == uid
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open

    # the workers: from each other only, every port (gloo's are ephemeral)
    workers = {
        "elastic.pytorch.org/job-name": "fenced",
        "elastic.pytorch.org/replica-type": "worker",
    }
    assert worker["spec"]["podSelector"] == {"matchLabels": workers}
    assert worker["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": workers}}]}]
    assert selected(c, ns, workers) == set(c.workers(ns, "fenced"))

    # the etcd: its client port, from the workers and the operator's pods only
    etcd_labels = {
        "elastic.pytorch.org/job-name": "fenced",
        "elastic.pytorch.org/replica-type": "etcd",
    }
    assert etcd["spec"]["podSelector"] == {"matchLabels": etcd_labels}
    [rule] = etcd["spec"]["ingress"]
    assert rule["ports"] == [{"port": 2379, "protocol": "TCP"}]
    from_workers, from_operator = rule["from"]
    assert from_workers == {"podSelector": {"matchLabels": workers}}
    assert from_operator["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": installed.namespace}
    }
    operator_pods = {p.metadata.name for p in installed.pods(running=True)}
    assert selected(c, installed.namespace, from_operator["podSelector"]["matchLabels"]) == (
        operator_pods
    )
    etcd_pods = wait_for("the etcd pod", lambda: selected(c, ns, etcd_labels))
    assert len(etcd_pods) == 1

    # restricted Pod Security, filled in where the template is silent
    pod = c.core.api_client.sanitize_for_serialization(
        c.core.read_namespaced_pod("fenced-worker-0", ns)
    )
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
    }
    etcd_pod = c.core.api_client.sanitize_for_serialization(
        c.core.read_namespaced_pod(etcd_pods.pop(), ns)
    )
    assert etcd_pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert etcd_pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    c.kubectl("-n", ns, "delete", "elasticjob", "fenced", "--wait=true", "--timeout=120s")
    wait_for("the policies garbage-collected", lambda: not policies(c, ns, "fenced"))


def connections_from(
    c: Cluster, ns: str, name: str, pod_labels: dict[str, str], targets: list[str]
) -> Obj:
    """What a pod wearing ``pod_labels`` sees when it connects to each of ``targets``."""
    c.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": pod_labels},
            "spec": {
                "restartPolicy": "Never",
                "securityContext": RESTRICTED_POD,
                "containers": [
                    {
                        "name": "connect",
                        "image": RUNTIME_IMAGE,
                        "command": CONNECT,
                        "env": [{"name": "TARGETS", "value": " ".join(targets)}],
                        "securityContext": RESTRICTED_CONTAINER,
                    }
                ],
            },
        },
    )
    try:

        def said() -> Obj | None:
            out = c.kubectl("-n", ns, "logs", name, check=False).stdout
            lines = [line for line in out.splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None

        return wait_for(f"{name}'s connections", said)
    finally:
        c.kubectl("-n", ns, "delete", "pod", name, "--wait=false", check=False)


@pytest.mark.skipif(
    not ENFORCED,
    reason="this cluster's network does not enforce NetworkPolicy (the devcluster's does "
    "not; make kind-e2e's does)",
)
def test_the_network_policies_keep_other_pods_off_a_jobs_workers_and_etcd(
    installed: Operator,
) -> None:
    c, ns = installed.cluster, installed.job_namespace
    c.apply(ns, job("walled", LISTEN, replicas=1))
    wait_for("the worker running", lambda: len(c.running_workers(ns, "walled")) == 1)
    wait_for("the policies", lambda: len(policies(c, ns, "walled")) == 2)
    wait_for(
        "the job's etcd available",
        lambda: c.apps.read_namespaced_deployment("walled-etcd", ns).status.available_replicas,
    )
    worker_ip = c.core.read_namespaced_pod("walled-worker-0", ns).status.pod_ip
    worker, etcd = f"{worker_ip}:{LISTEN_PORT}", f"walled-etcd.{ns}.svc:2379"

    # a pod the policies admit (it wears the job's worker labels) reaches both: they listen
    admitted = connections_from(c, ns, "admitted", labels("walled", "worker"), [worker, etcd])
    assert admitted == {worker: "open", etcd: "open"}
    # any other pod of the namespace reaches neither
    outsider = connections_from(c, ns, "outsider", {"app": "outsider"}, [worker, etcd])
    assert outsider[worker] != "open" and outsider[etcd] != "open", outsider

    c.kubectl("-n", ns, "delete", "elasticjob", "walled", "--wait=false")


def test_a_template_the_restricted_profile_forbids_is_refused_and_said_so(
    installed: Operator,
) -> None:
    c, ns = installed.cluster, installed.job_namespace
    doc = job("rooted", SLEEP, replicas=1)
    container = doc["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True}
    c.apply(ns, doc)

    def refused() -> Obj | None:
        conds = {x["type"]: x for x in c.status(ns, "rooted").get("conditions", [])}
        failure = conds.get("ReplicaFailure")
        return failure if failure and failure["status"] == "True" else None

    failure = wait_for("condition ReplicaFailure", refused)
    assert failure["reason"] == "FailedCreate"
    assert "rooted-worker-0" in failure["message"]
    assert 'violates PodSecurity "restricted:latest"' in failure["message"]
    assert "privileged" in failure["message"]
    events = c.core.list_namespaced_event(
        ns, field_selector="involvedObject.name=rooted,reason=FailedCreate"
    ).items
    assert [(e.type, e.message) for e in events] == [("Warning", failure["message"])]
    # the etcd was created in the round that stopped at the refused pod: that is said too
    provisioned = c.core.list_namespaced_event(
        ns, field_selector="involvedObject.name=rooted,reason=ProvisionedEtcd"
    ).items
    assert [e.message for e in provisioned] == ["created etcd rooted-etcd for the rendezvous"]
    assert c.status(ns, "rooted").get("restartCount", 0) == 0  # no replacement counted
    assert not c.workers(ns, "rooted")
    # the operator carried on: not a crash, not a restart
    [op_pod] = installed.pods(running=True)
    assert op_pod.status.container_statuses[0].restart_count == 0

    # the user drops what was refused: the worker starts and the condition clears
    c.kubectl(
        "-n",
        ns,
        "patch",
        "elasticjob",
        "rooted",
        "--type=json",
        "-p",
        json.dumps(
            [
                {
                    "op": "remove",
                    "path": "/spec/replicaSpecs/Worker/template/spec/containers/0/securityContext",
                }
            ]
        ),
    )
    wait_for("the worker running", lambda: len(c.running_workers(ns, "rooted")) == 1)
    wait_for("ReplicaFailure False", lambda: refused() is None)
    c.kubectl("-n", ns, "delete", "elasticjob", "rooted", "--wait=false")


def test_the_chart_value_turns_network_policies_off(cluster: Cluster) -> None:
    with installed_operator(cluster, "secoff", "--set", "networkPolicy.enabled=false") as op:
        ns = op.job_namespace
        cluster.apply(ns, job("open", SLEEP, replicas=1))
        wait_for("1 running worker", lambda: len(cluster.running_workers(ns, "open")) == 1)
        wait_for(
            "the etcd",
            lambda: cluster.apps.read_namespaced_deployment("open-etcd", ns).status.ready_replicas,
        )
        assert policies(cluster, ns, "open") == {}
        role = cluster.kubectl("-n", ns, "get", "role", op.fullname, "-o", "json").stdout
        assert "networkpolicies" not in role  # nor is the operator allowed to make any


# -- least privilege, from the audit log ----------------------------------------------------


def granted_rules(c: Cluster, op: Operator) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of the Role the chart rendered for the
    job namespace (`helm get manifest`: the release's templates as rendered)."""
    manifest = c.run("helm", "get", "manifest", op.release, "--namespace", op.namespace).stdout
    [role] = [
        d
        for d in yaml.safe_load_all(manifest)
        if d and d["kind"] == "Role" and d["metadata"]["namespace"] == op.job_namespace
    ]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def audit_events(cluster_dir: Path, user: str) -> list[Obj]:
    events: list[Obj] = []
    for path in sorted(cluster_dir.glob("audit*.log")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("user", {}).get("username") == user:
                events.append(event)
    return events


def used_rules(events: list[Obj]) -> tuple[set[tuple[str, str, str]], list[str]]:
    """What the requests asked for, as RBAC names it, and every refused request."""
    used, refused = set(), []
    for e in events:
        ref: dict[str, Any] = e.get("objectRef") or {}
        code = (e.get("responseStatus") or {}).get("code")
        what = f"{e['verb']} {e.get('requestURI')}"
        if code == 403:
            refused.append(f"{what}: {(e.get('responseStatus') or {}).get('message')}")
        if not ref.get("resource"):
            continue  # discovery (/api, /apis): every authenticated user may read it
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, e["verb"]))
    return used, refused


def test_the_operator_uses_exactly_what_the_chart_grants(
    cluster: Cluster, devcluster: DevCluster | None
) -> None:
    """One job through its life (children, events, status, a deleted pod replaced twice,
    scaled up and down, failed by its deadline, deleted by its TTL); then every request
    the operator's ServiceAccount made, from the API server's audit log, against the
    chart's rules: nothing refused, nothing granted that was not used."""
    if devcluster is None:
        pytest.skip("the audit log is the devcluster's; ELASTICJOB_E2E_KUBECONFIG points elsewhere")
    # gangScheduling: the devcluster does not serve the Workload API, so "auto" would grant
    # rights the operator never uses there (tests/unit/operator/test_chart.py shows them)
    with installed_operator(cluster, "audit", "--set", "gangScheduling.enabled=false") as op:
        c, ns, name = cluster, op.job_namespace, "life"
        c.apply(
            ns, job(name, SLEEP, replicas=2, ttlSecondsAfterFinished=5, podDisruptionBudget=True)
        )
        wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
        wait_for("the policies", lambda: len(policies(c, ns, name)) == 2)
        for restarts in (1, 2):  # the same event twice: counted (patched), not repeated
            old = c.core.read_namespaced_pod(f"{name}-worker-0", ns).metadata.uid
            c.kubectl("-n", ns, "delete", "pod", f"{name}-worker-0", "--wait=false")
            wait_for(
                f"replacement {restarts}",
                lambda old=old, restarts=restarts: (  # type: ignore[misc]
                    (p := c.running_workers(ns, name).get(f"{name}-worker-0")) is not None
                    and p.metadata.uid != old
                    and c.status(ns, name).get("restartCount") == restarts
                ),
            )
        c.kubectl("-n", ns, "scale", f"elasticjob/{name}", "--replicas=3")
        wait_for("3 running workers", lambda: len(c.running_workers(ns, name)) == 3)
        c.kubectl("-n", ns, "scale", f"elasticjob/{name}", "--replicas=2")
        wait_for("worker 2 gone", lambda: f"{name}-worker-2" not in c.workers(ns, name))
        c.kubectl(
            "-n", ns, "patch", "elasticjob", name, "--type=merge",
            "-p", '{"spec":{"activeDeadlineSeconds":1}}',
        )  # fmt: skip
        wait_for("the job deleted by its TTL", lambda: not c.list_jobs(ns))
        sa = f"system:serviceaccount:{op.namespace}:{op.fullname}"
        # the operator deletes the children once it sees the job gone (networkpolicies
        # are its last deletecollection): the audit log is read after that, not during it
        last = ("networking.k8s.io", "networkpolicies", "deletecollection")
        wait_for(
            "the operator to delete the deleted job's children",
            lambda: last in used_rules(audit_events(devcluster.dir, sa))[0],
        )
        events = audit_events(devcluster.dir, sa)
        assert events, f"no request by {sa} in the audit log"
        granted = granted_rules(c, op)
        used, refused = used_rules(events)
    print("the operator's requests:", sorted(used))
    assert not refused, "the API server refused the operator:\n" + "\n".join(refused)
    assert used <= granted, f"used but not granted: {sorted(used - granted)}"
    assert granted <= used, f"granted but never used: {sorted(granted - used)}"
