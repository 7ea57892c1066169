"""What the node agent's parts share, handed to each of them explicitly.

Node status, binding, sandboxes, volumes, containers, probes and events each take a
NodeContext rather than the Agent, so no part reaches into another's state: the API
client, the node's name and directories, the events wake the reconcile loop and stop
everything, whether the node still talks to the API server (Link, which faults switch
off), and the record of every process the agent starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticjob_devcluster import cgroups, procs

if TYPE_CHECKING:
    from elasticjob_devcluster.events import EventRecorder

HOST_IP = "127.0.0.1"  # the node's InternalIP, and every hostNetwork pod's IP


@dataclass
class Link:
    """Whether the node talks to the API server: the node-ready fault cuts it for a
    while (its pods keep running), lose-node for good."""

    heartbeat: bool = True
    lost: bool = False

    @property
    def up(self) -> bool:
        return self.heartbeat and not self.lost


@dataclass(frozen=True)
class NodeContext:
    node: str
    cluster: str  # the cluster network's name, also the cgroup subtree of its pods
    service_cidr: str
    state: Path  # this node's state directory (pods/, processes.json, control.sock)
    shared: Path  # the cluster's shared directory (PersistentVolumeClaims)
    core: Any  # kubernetes.client.CoreV1Api
    wake: threading.Event  # wakes the reconcile loop
    stop: threading.Event
    link: Link
    records: procs.RecordFile
    events: EventRecorder
    capacity: dict[str, str]  # the Node's capacity (and allocatable)
    ca_pem: str  # the cluster CA, for the kube-root-ca.crt ConfigMap
    path_env: str  # PATH of every container
    kube_ip: str  # the `kubernetes` Service's clusterIP
    apiserver_port: int  # on HOST_IP, for hostNetwork pods

    def wake_in(self, delay: float) -> None:
        """Wake the reconcile loop after `delay` (a daemon timer: never delays exit)."""
        t = threading.Timer(delay, self.wake.set)
        t.daemon = True
        t.start()

    def pod_cgroup(self, uid: str) -> Path | None:
        return cgroups.pod_path(self.cluster, self.node, uid)

    def container_cgroup(self, uid: str, container: str) -> Path | None:
        return cgroups.container_path(self.cluster, self.node, uid, container)

    def claims_dir(self, namespace: str) -> Path:
        """Where a namespace's PersistentVolumeClaims have their directories, one per
        claim by name, the same for pods on every node."""
        return self.shared / "pvc" / namespace
