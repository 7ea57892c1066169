"""The Node as kubelet shows it: registration, the status body, the Lease, the heartbeat.

The node lifecycle controller judges a node by its Lease (renewed every 5 s) and its
Ready condition (posted every 20 s), so the heartbeat thread keeps both fresh until a
fault cuts the node off. The bodies are pure functions; NodeReporter sends them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticjob_devcluster.kubeapi import MERGE_PATCH, TIMEOUT, ApiException, Obj, body
from elasticjob_devcluster.node_context import HOST_IP
from elasticjob_devcluster.pod_status import rfc3339

if TYPE_CHECKING:
    from elasticjob_devcluster.node_context import Link

log = logging.getLogger("elasticjob_devcluster.node_status")

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 5.0
STATUS_REPORT_S = 20.0
KUBELET_VERSION = "v1.35.4"
MAX_PODS = "110"

READY_REASONS = {
    "True": ("KubeletReady", "kubelet is posting ready status"),
    "False": ("KubeletNotReady", "fault injected: node reported NotReady"),
    "Unknown": ("NodeStatusUnknown", "Kubelet stopped posting node status."),
}


def arch(machine: str) -> str:
    return "amd64" if machine == "x86_64" else "arm64"


def node_capacity(cpus: int, meminfo: str) -> dict[str, str]:
    """What the Node offers: this machine's CPUs and memory (MemTotal of /proc/meminfo)."""
    mem_kib = 0
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cpu": str(cpus),
        "memory": f"{mem_kib}Ki",
        "pods": MAX_PODS,
        "ephemeral-storage": "100Gi",
    }


def machine_capacity() -> dict[str, str]:
    meminfo = ""
    with contextlib.suppress(OSError):
        meminfo = Path("/proc/meminfo").read_text()
    return node_capacity(os.cpu_count() or 1, meminfo)


def node_manifest(node: str, pod_cidr: str, machine: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node,
            "labels": {
                "kubernetes.io/hostname": node,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": arch(machine),
                "beta.kubernetes.io/os": "linux",
            },
        },
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
    }


class Transitions:
    """lastTransitionTime of each condition: when its status last changed."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}

    def since(self, ctype: str, status: str, now: str) -> str:
        old = self._seen.get(ctype)
        if old is None or old[0] != status:
            self._seen[ctype] = (status, now)
        return self._seen[ctype][1]


def status_body(
    node: str,
    ready: str,
    capacity: dict[str, str],
    kubelet_port: int,
    boot_id: str,
    uname: os.uname_result,
    transitions: Transitions,
    now: float,
) -> Obj:
    """The Node's status as a merge patch; ready is "True", "False" or "Unknown"."""
    stamp = rfc3339(now)

    def cond(ctype: str, status: str, reason: str, message: str) -> Obj:
        return {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": transitions.since(ctype, status, stamp),
        }

    return {
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                cond("Ready", ready, *READY_REASONS[ready]),
            ],
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": node},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": {
                "machineID": node,
                "systemUUID": node,
                "bootID": boot_id,
                "kernelVersion": uname.release,
                "osImage": "elasticjob devcluster",
                "containerRuntimeVersion": "devcluster://0.1.0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": arch(uname.machine),
            },
        }
    }


def micro_time(t: float) -> str:
    """A MicroTime as the API server wants it: RFC 3339 with microseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def lease_spec(node: str, now: float) -> Obj:
    return {
        "holderIdentity": node,
        "leaseDurationSeconds": LEASE_DURATION_S,
        "renewTime": micro_time(now),
    }


class NodeReporter:
    """Registers the Node and keeps its status and Lease fresh (the heartbeat)."""

    def __init__(
        self,
        core: Any,
        coord: Any,
        node: str,
        pod_cidr: str,
        kubelet_port: int,
        capacity: dict[str, str],
        link: Link,
    ) -> None:
        self.core = core
        self.coord = coord
        self.node = node
        self.pod_cidr = pod_cidr
        self.kubelet_port = kubelet_port
        self.capacity = capacity
        self.link = link
        self.boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        self.transitions = Transitions()

    def register(self) -> None:
        manifest = node_manifest(self.node, self.pod_cidr, platform.machine())
        try:
            self.core.create_node(body(manifest), _request_timeout=TIMEOUT)
        except ApiException as e:
            if e.status != 409:
                raise
        self.post_status()
        self.renew_lease()

    def post_status(self, ready: str = "True") -> None:
        status = status_body(
            self.node,
            ready,
            self.capacity,
            self.kubelet_port,
            self.boot_id,
            os.uname(),
            self.transitions,
            time.time(),
        )
        self.core.patch_node_status(
            self.node,
            status,
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=TIMEOUT,
        )

    def renew_lease(self) -> None:
        spec = lease_spec(self.node, time.time())
        try:
            self.coord.patch_namespaced_lease(
                self.node, LEASE_NAMESPACE, {"spec": spec}, _request_timeout=TIMEOUT
            )
        except ApiException as e:
            if e.status != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node, "namespace": LEASE_NAMESPACE},
                "spec": spec,
            }
            self.coord.create_namespaced_lease(
                LEASE_NAMESPACE, body(lease), _request_timeout=TIMEOUT
            )

    def set_ready(self, ready: bool, report: bool) -> None:
        """Cut the node off from the API server (report: first say Ready=Unknown), or
        reconnect it with a fresh Lease and status."""
        if not ready and report:
            with contextlib.suppress(Exception):
                self.post_status("Unknown")
        self.link.heartbeat = ready
        if ready:
            self.renew_lease()
            self.post_status()

    def heartbeat_loop(self, stop: threading.Event) -> None:
        last_status = time.monotonic()
        while not stop.wait(LEASE_RENEW_S):
            if not self.link.up:
                continue
            try:
                self.renew_lease()
                if time.monotonic() - last_status > STATUS_REPORT_S:
                    self.post_status()
                    last_status = time.monotonic()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
