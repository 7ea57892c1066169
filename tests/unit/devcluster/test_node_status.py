"""The Node's registration, status and Lease bodies, as kubelet writes them."""

from __future__ import annotations

import os

from elasticjob_devcluster.node_status import (
    KUBELET_VERSION,
    Transitions,
    lease_spec,
    micro_time,
    node_capacity,
    node_manifest,
    status_body,
)

MEMINFO = "MemTotal:       16318480 kB\nMemFree:         1234 kB\n"
UNAME = os.uname_result(("Linux", "box", "6.1.0", "#1", "x86_64"))


def conditions(body: dict[str, object]) -> dict[str, dict[str, str]]:
    status = body["status"]
    assert isinstance(status, dict)
    return {c["type"]: c for c in status["conditions"]}


def test_capacity_is_the_machines_cpus_and_memory() -> None:
    assert node_capacity(4, MEMINFO) == {
        "cpu": "4",
        "memory": "16318480Ki",
        "pods": "110",
        "ephemeral-storage": "100Gi",
    }
    assert node_capacity(1, "")["memory"] == "0Ki"


def test_the_node_is_labelled_with_its_name_os_and_arch() -> None:
    node = node_manifest("node-1", "10.244.1.0/24", "aarch64")
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "node-1"
    assert node["metadata"]["labels"]["kubernetes.io/arch"] == "arm64"
    assert node["spec"] == {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]}


def test_status_says_ready_with_kubelets_reasons_and_where_logs_are_served() -> None:
    body = status_body("n1", "True", {"cpu": "2"}, 10250, "boot", UNAME, Transitions(), 0.0)
    ready = conditions(body)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "KubeletReady")
    assert conditions(body)["MemoryPressure"]["status"] == "False"
    status = body["status"]
    assert status["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 10250}}
    assert status["nodeInfo"]["kubeletVersion"] == KUBELET_VERSION
    assert status["nodeInfo"]["architecture"] == "amd64"
    assert {"type": "InternalIP", "address": "127.0.0.1"} in status["addresses"]
    assert status["allocatable"] == status["capacity"] == {"cpu": "2"}


def test_a_conditions_transition_time_moves_only_when_its_status_changes() -> None:
    seen = Transitions()
    first = conditions(status_body("n", "True", {}, 1, "b", UNAME, seen, 100.0))["Ready"]
    same = conditions(status_body("n", "True", {}, 1, "b", UNAME, seen, 200.0))["Ready"]
    lost = conditions(status_body("n", "Unknown", {}, 1, "b", UNAME, seen, 300.0))["Ready"]
    assert same["lastTransitionTime"] == first["lastTransitionTime"]
    assert same["lastHeartbeatTime"] != first["lastHeartbeatTime"]
    assert lost["lastTransitionTime"] == lost["lastHeartbeatTime"] != first["lastTransitionTime"]
    assert lost["reason"] == "NodeStatusUnknown"


def test_the_lease_is_held_by_the_node_and_renewed_with_microseconds() -> None:
    assert micro_time(1.25) == "1970-01-01T00:00:01.250000Z"
    assert lease_spec("n1", 1.25) == {
        "holderIdentity": "n1",
        "leaseDurationSeconds": 40,
        "renewTime": "1970-01-01T00:00:01.250000Z",
    }
