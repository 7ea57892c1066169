"""The faults the e2e tests inject, on whichever cluster they run.

On the devcluster its node agents inject them (``elasticjob_devcluster.faults``). On a
kind cluster (``make kind-e2e`` sets ELASTICJOB_E2E_KIND_CLUSTER and DOCKER_HOST) they
are done inside the node's container, as an operator of a real node would: crictl finds a
pod's container and its pid, ``kill`` stops it, iptables in the pod's network namespace
drops everything but its loopback, and stopping the API server's container makes the
kubelet start its static pod again. Faults that need a node added to or lost from a
running cluster have no kind form here; on any other cluster ``cluster_faults`` skips.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import pytest
from kube_helpers import Cluster, wait_for

from elasticjob_devcluster import faults
from elasticjob_devcluster.controlplane import DevCluster

KIND_CLUSTER_ENV = "ELASTICJOB_E2E_KIND_CLUSTER"
# The session's worker nodes (conftest.py brings the devcluster up with them). Test
# modules import it from here, never from conftest: the integration suites' conftest has
# the same module name, and whichever pytest loaded last answers `from conftest import`.
E2E_NODES = ("node-1", "node-2")


class ClusterFaults(Protocol):
    """What a test may break under a running job, and the worker nodes it may check."""

    @property
    def nodes(self) -> tuple[str, ...]: ...  # the session's worker nodes

    def freeze_container(self, ns: str, pod: str) -> int: ...
    def cut_network(self, ns: str, pod: str) -> None: ...
    def restore_network(self, ns: str, pod: str) -> None: ...
    def restart_apiserver(self) -> None: ...


@dataclass
class DevclusterFaults:
    dev: DevCluster
    nodes: tuple[str, ...]

    def freeze_container(self, ns: str, pod: str) -> int:
        return faults.freeze_container(self.dev.dir, ns, pod)

    def cut_network(self, ns: str, pod: str) -> None:
        faults.cut_network(self.dev.dir, ns, pod)

    def restore_network(self, ns: str, pod: str) -> None:
        faults.restore_network(self.dev.dir, ns, pod)

    def restart_apiserver(self) -> None:
        self.dev.restart_apiserver()


# Everything but the pod's loopback, both ways: its agent and workers still talk among
# themselves, as they do behind a link that is down.
_CUT_RULES = (("INPUT", "!", "-i", "lo"), ("OUTPUT", "!", "-o", "lo"))


@dataclass
class KindFaults:
    cluster: Cluster
    name: str  # the kind cluster's name; its nodes are Docker containers of that name

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(
            sorted(
                n.metadata.name
                for n in self.cluster.core.list_node().items
                if "node-role.kubernetes.io/control-plane" not in (n.metadata.labels or {})
            )
        )

    def freeze_container(self, ns: str, pod: str) -> int:
        node, pid = self._main_pid(ns, pod)
        self._on(node, "kill", "-STOP", str(pid))
        return pid

    def cut_network(self, ns: str, pod: str) -> None:
        self._cut_rules(ns, pod, lambda chain: ("-I", chain, "1"))

    def restore_network(self, ns: str, pod: str) -> None:
        self._cut_rules(ns, pod, lambda chain: ("-D", chain))

    def _cut_rules(self, ns: str, pod: str, action: Callable[[str], tuple[str, ...]]) -> None:
        """Insert or delete (``action``: the iptables verb for a chain) the cut's rules in
        the pod's network namespace."""
        node, pid = self._main_pid(ns, pod)
        for chain, *match in _CUT_RULES:
            self._on(node, "nsenter", "-t", str(pid), "-n", "iptables", "-w", *action(chain),
                     *match, "-j", "DROP")  # fmt: skip

    def restart_apiserver(self) -> None:
        """Stop the kube-apiserver's container on the control plane; the kubelet starts
        its static pod again. Returns once the API answers /readyz."""
        plane = f"{self.name}-control-plane"
        ids = self._on(plane, "crictl", "ps", "-q", "--name", "^kube-apiserver$").split()
        if len(ids) != 1:
            raise AssertionError(f"{plane}: expected one kube-apiserver container, found {ids}")
        self._on(plane, "crictl", "stop", "--timeout", "15", ids[0])  # SIGTERM, as a restart
        wait_for(
            "the API server to answer again",
            lambda: self.cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
            180,
        )

    def _main_pid(self, ns: str, pod: str) -> tuple[str, int]:
        """The node running ``pod`` and its first container's main process, as the
        node's pid namespace numbers it."""
        found = self.cluster.core.read_namespaced_pod(pod, ns)
        statuses = found.status.container_statuses or []
        first = found.spec.containers[0].name
        cid = next((s.container_id for s in statuses if s.name == first and s.container_id), None)
        if cid is None:
            raise AssertionError(f"{ns}/{pod}: container {first} has not started")
        node = found.spec.node_name
        template = "{{.info.pid}}"
        out = self._on(node, "crictl", "inspect", "-o", "go-template", "--template", template,
                       cid.split("://", 1)[-1])  # fmt: skip
        return node, int(out.strip())

    def _on(self, node: str, *cmd: str) -> str:
        out = subprocess.run(
            ["docker", "exec", node, *cmd], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise AssertionError(f"on {node}: {' '.join(cmd)} failed: {out.stderr.strip()}")
        return out.stdout


def cluster_faults(
    cluster: Cluster, dev: DevCluster | None, dev_nodes: tuple[str, ...]
) -> ClusterFaults:
    """The faults for the cluster under test; skips the test on any other cluster."""
    if dev is not None:
        return DevclusterFaults(dev, dev_nodes)
    name = os.environ.get(KIND_CLUSTER_ENV)
    if not name:
        pytest.skip(f"injecting faults needs the devcluster or a kind cluster ({KIND_CLUSTER_ENV})")
    return KindFaults(cluster, name)
