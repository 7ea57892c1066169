"""The devcluster's node agent: plays kubelet for one Node by running pods as processes.

One OS process per Node. It registers the Node and keeps its Lease fresh, binds pending
pods (there is no kube-scheduler; see scheduling.py), and for every pod bound to it
creates a network namespace (network.py), materialises volumes, starts each container
through container_init (own mount+UTS namespaces, the pod's netns) with stdout/stderr
captured into CRI-format log files, reports status as kubelet does (pod_status.py),
honours restartPolicy, and on deletion sends SIGTERM, waits the grace period, SIGKILLs
the container's cgroup (cgroups.py: everything it started, whatever its session) and
completes the delete. `kubectl logs` is served by
kubelet_server.py; tests inject faults through a control socket (faults.py).

Networking (network.py, services.py, hosts.py): each pod has its own netns and IP from
the node's pod CIDR on a bridge shared by all nodes; clusterIPs (every Service's, and
10.96.0.1:443 for the API server, which pods find through KUBERNETES_SERVICE_HOST/PORT
as on a real cluster) are served by a relay in the cluster netns; names resolve through
a per-pod /etc/hosts rewritten in place as Services and pods change.

What a real kubelet does that this does not: pull images (the command runs from this
repo's Python environment), resource limits (so no OOMKilled), exec/attach/
port-forward, startup probes, preStop hooks, UDP Services and service env for
hostNetwork pods' clusterIPs. Restart back-off is 1 s doubling to 10 s. At agent
shutdown pods get at most 5 s of grace.

Threads: watchers fill an object cache and wake the single reconcile loop, which owns
all pod state; the heartbeat, prober, events, control socket and log server threads
only read it or hand requests over through a queue.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from elasticjob_devcluster import (
    cgroups,
    hosts,
    kubelet_server,
    network,
    procs,
    scheduling,
    services,
    volumes,
)
from elasticjob_devcluster.pod_env import (
    EnvError,
    PodContext,
    expand_command,
    referenced_objects,
    resolve_env,
)
from elasticjob_devcluster.pod_status import (
    ContainerRun,
    plan,
    pod_status,
    restart_policy,
    rfc3339,
    should_restart,
)
from elasticjob_devcluster.volumes import VolumeError, materialise

Obj = dict[str, Any]
log = logging.getLogger("elasticjob_devcluster.node_agent")

HOST_IP = "127.0.0.1"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 5.0
STATUS_REPORT_S = 20.0
SHUTDOWN_GRACE_CAP_S = 5.0
UNBOUND_FALLBACK_S = 3.0
TIMEOUT = 15
MERGE_PATCH = "application/merge-patch+json"  # lists (podIPs, conditions) replace, not merge
KUBELET_VERSION = "v1.35.4"
PROVISIONED_BY = "devcluster.elasticjob.dev/provisioned"


def _key(obj: Obj) -> str:
    m = obj.get("metadata") or {}
    return f"{m.get('namespace', '')}/{m.get('name')}"


class Cache:
    """The watched objects (raw JSON dicts) by kind and namespace/name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objs: dict[str, dict[str, Obj]] = {
            k: {} for k in ("pods", "services", "nodes", "pvcs", "pvs")
        }
        self.synced: set[str] = set()

    def items(self, kind: str) -> list[Obj]:
        with self.lock:
            return list(self.objs[kind].values())

    def get(self, kind: str, key: str) -> Obj | None:
        with self.lock:
            return self.objs[kind].get(key)


@dataclass
class PodRuntime:
    """Everything the agent holds for one pod it runs (owned by the reconcile loop)."""

    uid: str
    namespace: str
    name: str
    dir: Path
    pod: Obj
    ip: str = ""
    netns: str = ""
    sandbox: bool = False
    start_time: float = field(default_factory=time.time)
    runs: dict[str, ContainerRun] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_paths: dict[str, list[Path]] = field(default_factory=dict)
    phase: str = "Pending"
    kill_deadline: float | None = None
    sigterm_sent: bool = False
    last_status: Obj | None = None
    token_refresh_at: float = 0.0
    hosts_text: str = ""
    volumes_ready: bool = False
    torn_down: bool = False
    network_cut: bool = False
    probes: dict[str, ProbeState] = field(default_factory=dict)

    @property
    def spec(self) -> Obj:
        spec: Obj = self.pod.get("spec") or {}
        return spec

    @property
    def hosts_path(self) -> Path:
        return self.dir / "hosts"


@dataclass
class ProbeState:
    next_at: float
    successes: int = 0
    failures: int = 0


# the client's helpers are untyped; these are their real shapes
_new_client: Callable[..., Any] = config.new_client_from_config
_Watch: Callable[[], Any] = watch.Watch


def _body(obj: Obj) -> Any:
    """A plain JSON body where the typed client expects a model (it sends dicts as-is)."""
    return obj


def pod_hostname(pod: Obj) -> str:
    """spec.hostname or the pod name, cut to 63 characters as kubelet does."""
    spec = pod.get("spec") or {}
    if spec.get("hostNetwork") and spec.get("nodeName"):
        return str(spec["nodeName"])  # the node's name, as a host-network pod sees it
    name = str(spec.get("hostname") or pod["metadata"]["name"])
    return name[:63].rstrip("-.") or name[:63]


def probe_port(container: Obj, port: int | str) -> int:
    """A probe's port, by number or by the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def _group_exists(rec: procs.ProcessRecord) -> bool:
    """The recorded process (not a reuse of its pid) or its process group still exists."""
    if procs.start_ticks(rec.pid) not in (None, rec.start_ticks):
        return False
    try:
        os.killpg(rec.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _raw(resp: Any) -> Obj:
    data: Obj = json.loads(resp.data)
    return data


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.node: str = args.node
        self.state = Path(args.state_dir).resolve()
        self.shared = Path(args.shared_dir or self.state.parent.parent / "shared").resolve()
        self.procs_file = self.state / "processes.json"
        self.api = _new_client(config_file=args.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.cache = Cache()
        self.pods: dict[str, PodRuntime] = {}
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.requests: queue.Queue[tuple[Obj, queue.Queue[Obj]]] = queue.Queue()
        self.events: queue.Queue[Obj] = queue.Queue()
        self.hosts_dirty = True
        self.heartbeat = True
        self.lost = False
        self.first_seen_unbound: dict[str, float] = {}
        self.deleted: set[str] = set()  # uids whose delete we completed (the watch may lag)
        self.net = ipaddress.ip_network(args.pod_cidr)
        self.records_lock = threading.Lock()
        self.ca_pem = Path(args.ca_file).read_text()
        self.path_env = self._path_env()
        self.capacity: dict[str, str] = {}
        self.boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        self._transitions: dict[str, tuple[str, str]] = {}
        self.log_server: Any = None
        self.kube_ip = str(ipaddress.ip_network(args.service_cidr)[1])
        cluster = args.cluster_network
        # clusterIPs live in the cluster netns: the API server's (relayed to the host's
        # loopback) and every Service's (relayed to ready pods over the bridge)
        self.api_proxy = network.Proxy(cluster, dial_ns="")
        self.service_proxy = network.Proxy(cluster, dial_ns=cluster)
        self.control: socket.socket | None = None

    # ---------------------------------------------------------------- setup
    def timer(self, delay: float, fn: Callable[[], object]) -> None:
        """Call fn after delay on a daemon thread (so a pending wake never delays exit)."""
        t = threading.Timer(delay, fn)
        t.daemon = True
        t.start()

    def _path_env(self) -> str:
        """The agent's PATH for the pods, with this venv's bin on it (first, unless the
        agent's PATH already places it, e.g. after the cluster's own etcd 3.6 bin dir)."""
        venv_bin = str(Path(sys.executable).parent)
        parts = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
        return os.pathsep.join(parts if venv_bin in parts else [venv_bin, *parts])

    def clean_previous_run(self) -> None:
        """Reap what an earlier incarnation of this agent left (it may have been killed)."""
        procs.stop(procs.load_records(self.procs_file), grace_seconds=1)
        cgroups.kill(cgroups.node_path(self.args.cluster_network, self.args.node))
        procs.save_records(self.procs_file, [])
        network.delete_node_pods_netns(self.state, self.args.cluster_network)
        volumes.unmount_under(self.state / "pods")
        shutil.rmtree(self.state / "pods", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.state / "control.sock").unlink()

    def register_node(self) -> None:
        cpu = os.cpu_count() or 1
        mem_kib = 0
        with contextlib.suppress(OSError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    mem_kib = int(line.split()[1])
        capacity = {
            "cpu": str(cpu),
            "memory": f"{mem_kib}Ki",
            "pods": "110",
            "ephemeral-storage": "100Gi",
        }
        self.capacity = capacity
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {
                    "kubernetes.io/hostname": self.node,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64" if platform.machine() == "x86_64" else "arm64",
                    "beta.kubernetes.io/os": "linux",
                },
            },
            "spec": {"podCIDR": self.args.pod_cidr, "podCIDRs": [self.args.pod_cidr]},
        }
        try:
            self.core.create_node(_body(body), _request_timeout=TIMEOUT)
        except client.ApiException as e:
            if e.status != 409:
                raise
        self.post_node_status()
        self.renew_lease()

    def node_status(self, ready: str = "True") -> Obj:
        now = rfc3339(time.time())

        def cond(ctype: str, status: str, reason: str, message: str) -> Obj:
            return {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._transition(ctype, status, now),
            }

        ready_reason = {
            "True": ("KubeletReady", "kubelet is posting ready status"),
            "False": ("KubeletNotReady", "fault injected: node reported NotReady"),
            "Unknown": ("NodeStatusUnknown", "Kubelet stopped posting node status."),
        }[ready]
        uname = os.uname()
        return {
            "status": {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "conditions": [
                    cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                    cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                    cond("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                    cond("Ready", ready, *ready_reason),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": HOST_IP},
                    {"type": "Hostname", "address": self.node},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.args.kubelet_port}},
                "nodeInfo": {
                    "machineID": self.node,
                    "systemUUID": self.node,
                    "bootID": self.boot_id,
                    "kernelVersion": uname.release,
                    "osImage": "elasticjob devcluster",
                    "containerRuntimeVersion": "devcluster://0.1.0",
                    "kubeletVersion": KUBELET_VERSION,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64" if uname.machine == "x86_64" else "arm64",
                },
            }
        }

    def _transition(self, ctype: str, status: str, now: str) -> str:
        old = self._transitions.get(ctype)
        if old is None or old[0] != status:
            self._transitions[ctype] = (status, now)
        return self._transitions[ctype][1]

    def post_node_status(self, ready: str = "True") -> None:
        self.core.patch_node_status(
            self.node,
            self.node_status(ready),
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=TIMEOUT,
        )

    def renew_lease(self) -> None:
        now = time.time()
        micro = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.node, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": micro,
            },
        }
        try:
            self.coord.patch_namespaced_lease(
                self.node, "kube-node-lease", {"spec": body["spec"]}, _request_timeout=TIMEOUT
            )
        except client.ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease(
                "kube-node-lease", _body(body), _request_timeout=TIMEOUT
            )

    def heartbeat_loop(self) -> None:
        last_status = time.monotonic()
        while not self.stop.wait(LEASE_RENEW_S):
            if not self.heartbeat or self.lost:
                continue
            try:
                self.renew_lease()
                if time.monotonic() - last_status > STATUS_REPORT_S:
                    self.post_node_status()
                    last_status = time.monotonic()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)

    # ---------------------------------------------------------------- watches
    def informer(self, kind: str, list_fn: Callable[..., Any], **kwargs: Any) -> None:
        """List then watch `kind` into the cache, forever (relist on any error or 410)."""
        while not self.stop.is_set():
            try:
                data = _raw(list_fn(_preload_content=False, _request_timeout=TIMEOUT, **kwargs))
                fresh = {_key(o): o for o in data.get("items") or []}
                with self.cache.lock:
                    self.cache.objs[kind] = fresh
                    self.cache.synced.add(kind)
                self._changed(kind)
                rv = data["metadata"]["resourceVersion"]
                w = _Watch()
                for ev in w.stream(
                    list_fn,
                    resource_version=rv,
                    timeout_seconds=120,
                    allow_watch_bookmarks=True,
                    deserialize=False,
                    _request_timeout=150,
                    **kwargs,
                ):
                    if self.stop.is_set():
                        w.stop()
                        return
                    etype, obj = ev["type"], ev.get("raw_object") or ev["object"]
                    if etype == "ERROR":
                        break
                    if etype == "BOOKMARK":
                        continue
                    with self.cache.lock:
                        if etype == "DELETED":
                            self.cache.objs[kind].pop(_key(obj), None)
                        else:
                            self.cache.objs[kind][_key(obj)] = obj
                    self._changed(kind)
            except Exception as e:
                if not self.stop.is_set():
                    log.warning("watch %s: %s; relisting", kind, e)
                    time.sleep(1)

    def _changed(self, kind: str) -> None:
        if kind in ("pods", "services"):
            self.hosts_dirty = True
        self.wake.set()

    # ---------------------------------------------------------------- events
    def event(self, pod: Obj, etype: str, reason: str, message: str, component: str = "") -> None:
        """Queue a core/v1 Event about a pod (what `kubectl describe pod` shows)."""
        if self.lost or not self.heartbeat:
            return
        m = pod["metadata"]
        now = rfc3339(time.time())
        comp = component or "kubelet"
        self.events.put(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{m['name']}.", "namespace": m["namespace"]},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": m["name"],
                    "namespace": m["namespace"],
                    "uid": m["uid"],
                },
                "reason": reason,
                "message": message,
                "type": etype,
                "source": {"component": comp, "host": self.node},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "reportingComponent": comp,
                "reportingInstance": self.node,
            }
        )

    def event_loop(self) -> None:
        while not self.stop.is_set():
            try:
                ev = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            with contextlib.suppress(Exception):  # an event is best effort, as in kubelet
                self.core.create_namespaced_event(
                    ev["metadata"]["namespace"],
                    _body(ev),
                    _preload_content=False,
                    _request_timeout=TIMEOUT,
                )

    # ---------------------------------------------------------------- records
    def record_process(self, proc: subprocess.Popen[bytes], what: str) -> None:
        ticks = procs.start_ticks(proc.pid)
        rec = procs.ProcessRecord(what, proc.pid, ticks if ticks is not None else -1)
        with self.records_lock:
            # drop records whose whole group is gone (exec probes would pile up otherwise)
            live = [r for r in procs.load_records(self.procs_file) if _group_exists(r)]
            procs.save_records(self.procs_file, [*live, rec])

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> None:
        if not self.heartbeat or self.lost:
            return
        pods = self.cache.items("pods")
        nodes = self.cache.items("nodes")
        me = next((n for n in nodes if n["metadata"]["name"] == self.node), None)
        if me is None:
            return
        now = time.monotonic()
        pending = [p for p in pods if scheduling.wants_scheduling(p)]
        live = {p["metadata"]["uid"] for p in pending}
        for uid in list(self.first_seen_unbound):
            if uid not in live:
                del self.first_seen_unbound[uid]
        for p in pending:
            uid = p["metadata"]["uid"]
            first = self.first_seen_unbound.setdefault(uid, now)
            choice = scheduling.choose_node(p, nodes, pods)
            late = now - first > UNBOUND_FALLBACK_S and scheduling.fits(p, me)
            if choice == self.node or late:
                self.bind(p)
            elif choice is None and now - first > UNBOUND_FALLBACK_S:
                self.report_unschedulable(p, nodes)

    def report_unschedulable(self, pod: Obj, nodes: list[Obj]) -> None:
        """PodScheduled=False/Unschedulable, as kube-scheduler says it; posted once, by the
        first Ready node by name, so `kubectl describe` explains a pod stuck Pending."""
        if not self.is_leader():
            return
        conds = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conds):
            return
        m = pod["metadata"]
        message = scheduling.unschedulable_message(pod, nodes)
        cond = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": rfc3339(time.time()),
            "lastProbeTime": None,
        }
        try:
            self.core.patch_namespaced_pod_status(
                m["name"],
                m["namespace"],
                {"status": {"conditions": [cond]}},
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )  # strategic merge: conditions merge by type
            self.event(pod, "Warning", "FailedScheduling", message, "default-scheduler")
        except client.ApiException as e:
            log.warning("unschedulable %s/%s: %s", m["namespace"], m["name"], e.reason)

    def bind(self, pod: Obj) -> None:
        m = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
        }
        try:
            self.core.create_namespaced_pod_binding(
                m["name"],
                m["namespace"],
                _body(body),
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
            log.info("bound %s/%s", m["namespace"], m["name"])
            msg = f"Successfully assigned {m['namespace']}/{m['name']} to {self.node}"
            self.event(pod, "Normal", "Scheduled", msg, component="default-scheduler")
        except client.ApiException as e:
            if e.status not in (404, 409):
                log.warning("binding %s/%s: %s", m["namespace"], m["name"], e.reason)

    # ---------------------------------------------------------------- reconcile
    def run(self) -> None:
        threads = [
            ("pods", self.core.list_pod_for_all_namespaces),
            ("services", self.core.list_service_for_all_namespaces),
            ("nodes", self.core.list_node),
            ("pvcs", self.core.list_persistent_volume_claim_for_all_namespaces),
            ("pvs", self.core.list_persistent_volume),
        ]
        for kind, fn in threads:
            threading.Thread(
                target=self.informer, args=(kind, fn), name=f"watch-{kind}", daemon=True
            ).start()
        threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self.event_loop, name="events", daemon=True).start()
        threading.Thread(target=self.prober_loop, name="prober", daemon=True).start()
        self.control_server()
        network.route_services(self.args.cluster_network, self.args.service_cidr)
        self.api_proxy.set_routes({(self.kube_ip, 443): [("127.0.0.1", self.args.apiserver_port)]})
        self.log_server = kubelet_server.serve(
            self.args.kubelet_port,
            Path(self.args.serving_cert),
            Path(self.args.serving_key),
            Path(self.args.client_ca_file),
            self.lookup_logs,
        )
        while not self.stop.is_set():
            self.wake.wait(timeout=1.0)
            self.wake.clear()
            self.handle_requests()
            if self.stop.is_set():
                break
            if len(self.cache.synced) < len(self.cache.objs):
                continue
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile failed")
                time.sleep(0.5)
        self.shutdown()

    def reconcile(self) -> None:
        if self.lost:
            return
        self.schedule()
        if self.heartbeat and self.is_leader():
            self.provision_volumes()
        mine = {
            p["metadata"]["uid"]: p
            for p in self.cache.items("pods")
            if (p.get("spec") or {}).get("nodeName") == self.node
        }
        self.deleted &= set(mine)
        for uid, pod in mine.items():
            if uid in self.deleted:
                continue
            rt = self.pods.get(uid)
            if rt is None:
                phase = (pod.get("status") or {}).get("phase")
                if phase in ("Succeeded", "Failed") and not pod["metadata"].get(
                    "deletionTimestamp"
                ):
                    continue  # finished before this agent started; nothing to run
                rt = self.admit(pod)
            rt.pod = pod
            try:
                self.sync_pod(rt)
            except Exception:
                log.exception("pod %s/%s", rt.namespace, rt.name)
        for uid in list(self.pods):
            if uid not in mine:
                # force-deleted (or rebound elsewhere): stop it without grace
                gone = self.pods.pop(uid)
                self.kill_all(gone, signal.SIGKILL)
                self.teardown(gone, remove_dir=True)
        if self.hosts_dirty:
            self.hosts_dirty = False
            self.sync_service_proxy()
            for rt in self.pods.values():
                self.write_hosts(rt)

    def admit(self, pod: Obj) -> PodRuntime:
        m = pod["metadata"]
        rt = PodRuntime(m["uid"], m["namespace"], m["name"], self.state / "pods" / m["uid"], pod)
        rt.dir.mkdir(parents=True, exist_ok=True)
        prev = pod.get("status") or {}
        # carry restart counts over from the API (an agent restart is not a pod restart)
        for cs in (prev.get("containerStatuses") or []) + (prev.get("initContainerStatuses") or []):
            if cs.get("restartCount"):
                rt.runs[cs["name"]] = ContainerRun(cs["name"], starts=int(cs["restartCount"]) + 1)
        self.pods[rt.uid] = rt
        return rt

    def allocate_ip(self) -> str:
        used = {rt.ip for rt in self.pods.values() if rt.netns and not rt.torn_down}
        for host in list(self.net.hosts())[1:]:
            if str(host) not in used:
                return str(host)
        raise RuntimeError(f"pod CIDR {self.net} is full")

    def sync_pod(self, rt: PodRuntime) -> None:
        now = time.time()
        self.reap(rt, now)
        if rt.pod["metadata"].get("deletionTimestamp"):
            self.terminate(rt, now)
            return
        terminal = rt.phase in ("Succeeded", "Failed")
        if not terminal:
            if not rt.sandbox:
                self.create_sandbox(rt)
                # publish the pod IP before the containers start, so peers' hosts files
                # (hostname.subdomain of headless Services) have it as early as possible
                self.post_status(rt, now)
            self.refresh_tokens(rt, now)
            p = plan(rt.spec, rt.runs, now)
            for name in p.start:
                self.start_container(rt, name, now)
            p = plan(rt.spec, rt.runs, now)
            rt.phase = p.phase
            if p.wake_at is not None:
                delay = max(0.05, p.wake_at - now)
                self.timer(delay, self.wake.set)
            if rt.phase in ("Succeeded", "Failed"):
                self.kill_all(rt, signal.SIGKILL)
                self.teardown(rt, remove_dir=False)
        self.post_status(rt, now)

    def sync_service_proxy(self) -> None:
        if self.lost:
            return
        table = services.proxy_table(self.cache.items("services"), self.cache.items("pods"))
        table.pop((self.kube_ip, 443), None)
        self.service_proxy.set_routes(table)

    def is_leader(self) -> bool:
        """Cluster-wide chores (volumes, Unschedulable) fall to the first Ready node."""
        nodes = self.cache.items("nodes")
        ready = sorted(n["metadata"]["name"] for n in nodes if scheduling.node_ready(n))
        return bool(ready) and ready[0] == self.node

    def provision_volumes(self) -> None:
        """A provisioner for every StorageClass: each Pending claim gets a hostPath PV on its
        shared directory (the one pods mount), pre-bound so the PV controller binds them;
        a Released PV made here is deleted with its directory (reclaim policy Delete)."""
        for pvc in self.cache.items("pvcs"):
            m, spec = pvc["metadata"], pvc.get("spec") or {}
            if spec.get("volumeName") or (pvc.get("status") or {}).get("phase") != "Pending":
                continue
            name = f"pvc-{m['uid']}"
            if self.cache.get("pvs", f"/{name}") is not None:
                continue
            path = self.shared / "pvc" / m["namespace"] / m["name"]
            path.mkdir(parents=True, exist_ok=True)
            size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
            pv: Obj = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": name, "labels": {PROVISIONED_BY: "true"}},
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "storageClassName": spec.get("storageClassName") or "",
                    "volumeMode": spec.get("volumeMode") or "Filesystem",
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                    "claimRef": {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "namespace": m["namespace"],
                        "name": m["name"],
                        "uid": m["uid"],
                    },
                },
            }
            try:
                self.core.create_persistent_volume(
                    _body(pv), _preload_content=False, _request_timeout=TIMEOUT
                )
                log.info("provisioned %s for %s/%s", name, m["namespace"], m["name"])
            except client.ApiException as e:
                if e.status != 409:
                    log.warning("provisioning %s: %s", name, e.reason)
        for pv in self.cache.items("pvs"):
            labels = pv["metadata"].get("labels") or {}
            if labels.get(PROVISIONED_BY) and (pv.get("status") or {}).get("phase") == "Released":
                path = Path(pv["spec"]["hostPath"]["path"])
                if self.shared in path.parents:
                    shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(client.ApiException):
                    self.core.delete_persistent_volume(
                        pv["metadata"]["name"], _preload_content=False, _request_timeout=TIMEOUT
                    )

    # ---------------------------------------------------------------- sandbox
    def create_sandbox(self, rt: PodRuntime) -> None:
        """The pod's netns (hostNetwork pods share the host's network) and /dev/shm."""
        if not rt.spec.get("hostIPC"):  # the runtime's own /dev/shm, shared by the pod
            volumes.mount_tmpfs(self.sandbox_shm(rt), volumes.DEFAULT_SHM_BYTES, 0o1777)
        if rt.spec.get("hostNetwork"):
            rt.ip = HOST_IP
            self.write_hosts(rt)
        else:
            rt.ip = self.allocate_ip()
            self.write_hosts(rt)
            rt.netns = network.create_pod_netns(
                self.args.cluster_network, rt.uid, rt.ip, self.args.service_cidr
            )

        rt.sandbox = True
        rt.start_time = time.time()
        self.hosts_dirty = True
        log.info("pod %s/%s sandbox %s ip %s", rt.namespace, rt.name, rt.netns, rt.ip)

    def sandbox_shm(self, rt: PodRuntime) -> Path:
        return rt.dir / "shm"

    def write_hosts(self, rt: PodRuntime) -> None:
        if rt.torn_down:
            return
        pod = dict(rt.pod)
        pod["status"] = dict(pod.get("status") or {}, podIP=rt.ip)
        text = hosts.hosts_file(
            pod, self.cache.items("pods"), self.cache.items("services"), network.REFUSE_IP
        )
        if text == rt.hosts_text:
            return
        # in place: the container's /etc/hosts is a bind mount of this very inode
        with open(rt.hosts_path, "a+") as f:
            f.seek(0)
            f.truncate()
            f.write(text)
        rt.hosts_text = text

    def teardown(self, rt: PodRuntime, remove_dir: bool) -> None:
        cgroups.kill(cgroups.pod_path(self.args.cluster_network, self.args.node, rt.uid))
        if not rt.torn_down:
            if rt.netns:
                network.delete_pod_netns(rt.uid, self.args.cluster_network)
            rt.torn_down = True
        volumes.unmount_under(rt.dir)  # tmpfs: /dev/shm and emptyDir medium Memory
        if remove_dir:
            shutil.rmtree(rt.dir, ignore_errors=True)

    # ---------------------------------------------------------------- volumes
    def fetch(self, kind: str, namespace: str, names: set[str]) -> dict[str, Obj]:
        out: dict[str, Obj] = {}
        for name in names:
            fn = (
                self.core.read_namespaced_config_map
                if kind == "configmap"
                else self.core.read_namespaced_secret
            )
            try:
                out[name] = _raw(
                    fn(name, namespace, _preload_content=False, _request_timeout=TIMEOUT)
                )
            except client.ApiException as e:
                if e.status != 404:
                    raise
        if kind == "configmap" and "kube-root-ca.crt" in names and "kube-root-ca.crt" not in out:
            out["kube-root-ca.crt"] = {"data": {"ca.crt": self.ca_pem}}
        return out

    def volume_dir(self, rt: PodRuntime, name: str) -> Path:
        return rt.dir / "volumes" / name

    def prepare_volumes(self, rt: PodRuntime, cms: dict[str, Obj], secrets: dict[str, Obj]) -> None:
        for vol in rt.spec.get("volumes") or []:
            target = self.volume_dir(rt, vol["name"])
            materialise(
                vol,
                target,
                rt.pod,
                cms,
                secrets,
                pvc_root=self.shared / "pvc" / rt.namespace,
                token=lambda aud, secs: self.request_token(rt, aud, secs),
            )
        rt.volumes_ready = True
        rt.token_refresh_at = time.time() + 0.8 * 3600

    def request_token(self, rt: PodRuntime, audience: str | None, seconds: int) -> str:
        sa = rt.spec.get("serviceAccountName") or "default"
        body: Obj = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": rt.name,
                    "uid": rt.uid,
                },
            },
        }
        if audience:
            body["spec"]["audiences"] = [audience]
        resp = _raw(
            self.core.create_namespaced_service_account_token(
                sa, rt.namespace, _body(body), _preload_content=False, _request_timeout=TIMEOUT
            )
        )
        token: str = resp["status"]["token"]
        return token

    def refresh_tokens(self, rt: PodRuntime, now: float) -> None:
        if rt.volumes_ready and now >= rt.token_refresh_at:
            rt.volumes_ready = False  # the next container start (or now) rewrites them
            cms, secrets = self.referenced(rt)
            self.prepare_volumes(rt, cms, secrets)

    def referenced(self, rt: PodRuntime) -> tuple[dict[str, Obj], dict[str, Obj]]:
        cm_names, secret_names = referenced_objects(rt.pod)
        return (
            self.fetch("configmap", rt.namespace, cm_names),
            self.fetch("secret", rt.namespace, secret_names),
        )

    def mounts(self, rt: PodRuntime, c: Obj) -> list[Obj]:
        kinds = {v["name"]: v for v in rt.spec.get("volumes") or []}
        out: list[Obj] = []
        if not rt.spec.get("hostIPC") and not volumes.mounts_shm(c):
            out.append({"source": str(self.sandbox_shm(rt)), "target": volumes.SHM_PATH})
        for vm in c.get("volumeMounts") or []:
            vol = kinds.get(vm["name"])
            if vol is None:
                raise EnvError(f"volumeMount {vm['name']!r} names no volume of the pod")
            source = self.volume_dir(rt, vm["name"])
            if vol.get("hostPath"):
                source = Path(vol["hostPath"]["path"])
            elif vol.get("persistentVolumeClaim"):
                source = (
                    self.shared / "pvc" / rt.namespace / vol["persistentVolumeClaim"]["claimName"]
                )
            if vm.get("subPath"):
                source = source / vm["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            ro = bool(vm.get("readOnly")) or any(
                k in vol for k in ("configMap", "secret", "projected", "downwardAPI")
            )
            out.append({"source": str(source), "target": vm["mountPath"], "read_only": ro})
        return out

    # ---------------------------------------------------------------- containers
    def container_spec(self, rt: PodRuntime, name: str) -> Obj:
        for c in (rt.spec.get("initContainers") or []) + (rt.spec.get("containers") or []):
            if c["name"] == name:
                spec: Obj = c
                return spec
        raise KeyError(name)

    def start_container(self, rt: PodRuntime, name: str, now: float) -> None:
        c = self.container_spec(rt, name)
        run = rt.runs.setdefault(name, ContainerRun(name, image=str(c.get("image") or "")))
        try:
            cms, secrets = self.referenced(rt)
            if not rt.volumes_ready:
                self.prepare_volumes(rt, cms, secrets)
            hostname = pod_hostname(rt.pod)
            base: dict[str, str] = {}
            if rt.spec.get("enableServiceLinks", True):
                base.update(services.service_env(self.cache.items("services"), rt.namespace))
            base |= {
                "PATH": self.path_env,
                "HOSTNAME": hostname,
                "HOME": str(rt.dir / "home"),
                "KUBERNETES_SERVICE_HOST": self.kube_ip,
                "KUBERNETES_SERVICE_PORT": "443",
                "KUBERNETES_SERVICE_PORT_HTTPS": "443",
                "KUBERNETES_PORT": f"tcp://{self.kube_ip}:443",
                "KUBERNETES_PORT_443_TCP": f"tcp://{self.kube_ip}:443",
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
                "KUBERNETES_PORT_443_TCP_PORT": "443",
                "KUBERNETES_PORT_443_TCP_ADDR": self.kube_ip,
            }
            if rt.spec.get("hostNetwork"):  # no clusterIPs out there: the API server directly
                port = str(self.args.apiserver_port)
                base |= {
                    "KUBERNETES_SERVICE_HOST": HOST_IP,
                    "KUBERNETES_SERVICE_PORT": port,
                    "KUBERNETES_SERVICE_PORT_HTTPS": port,
                    "KUBERNETES_PORT": f"tcp://{HOST_IP}:{port}",
                }
            ctx = PodContext(rt.ip, HOST_IP, self.capacity)
            env = resolve_env(rt.pod, c, ctx, cms, secrets, base)
            argv = expand_command(c, env)
            mounts = self.mounts(rt, c)
        except (EnvError, VolumeError, client.ApiException, OSError) as e:
            if run.waiting_reason != "CreateContainerConfigError":
                self.event(rt.pod, "Warning", "Failed", f"Error: {e}")
            run.waiting_reason = "CreateContainerConfigError"
            run.waiting_message = str(e)[:500]
            run.next_start_at = now + 2.0
            self.timer(2.0, self.wake.set)
            log.warning("pod %s/%s container %s: %s", rt.namespace, rt.name, name, e)
            return
        (rt.dir / "home").mkdir(exist_ok=True)
        n = run.starts
        spec_path = rt.dir / "containers" / f"{name}-{n}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(
            json.dumps(
                {
                    "netns": str(network.NETNS_DIR / rt.netns) if rt.netns else "",
                    "hostname": hostname,
                    "hosts_file": str(rt.hosts_path),
                    "mounts": mounts,
                    "working_dir": c.get("workingDir") or "",
                    "argv": argv,
                    "env": env,
                    "cgroup": str(self.container_cgroup(rt, name) or ""),
                }
            )
        )
        log_path = rt.dir / "logs" / name / f"{n}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        proc = subprocess.Popen(
            [sys.executable, "-m", "elasticjob_devcluster.container_init", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd="/",
            env={"PATH": self.path_env},
        )
        self.record_process(proc, f"pod {rt.namespace}/{rt.name} container {name} #{n}")
        rt.procs[name] = proc
        rt.log_paths.setdefault(name, []).append(log_path)
        run.started(proc.pid, f"devcluster://{rt.uid}/{name}/{n}", now)
        rt.probes.pop(name, None)
        rt.probes.pop(f"{name}#liveness", None)
        out = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed by the last reader
        lock = threading.Lock()
        readers = [proc.stdout, proc.stderr]
        remaining = [2]

        def pump(stream: Any, label: str) -> None:
            from elasticjob_devcluster import logs

            try:
                while chunk := os.read(stream.fileno(), 65536):
                    with lock:
                        out.write(logs.encode_chunk(chunk, label, time.time()))
            finally:
                stream.close()
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        out.close()

        for stream, label in zip(readers, ("stdout", "stderr"), strict=True):
            threading.Thread(target=pump, args=(stream, label), daemon=True).start()

        def waiter() -> None:
            proc.wait()
            self.wake.set()

        threading.Thread(target=waiter, daemon=True).start()
        log.info("pod %s/%s container %s started pid %d", rt.namespace, rt.name, name, proc.pid)
        self.event(rt.pod, "Normal", "Started", f"Started container {name}")

    def reap(self, rt: PodRuntime, now: float) -> None:
        for name, proc in list(rt.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what the main process left behind
            cgroups.kill(self.container_cgroup(rt, name))  # also in sessions of their own
            del rt.procs[name]
            run = rt.runs[name]
            error_file = rt.dir / "containers" / f"{name}-{run.starts - 1}.json.error"
            start_error = ""
            with contextlib.suppress(OSError):
                start_error = error_file.read_text()
            if code < 0:
                run.exited(0, -code, now)
            else:
                run.exited(code, None, now, start_error)
            log.info("pod %s/%s container %s exited %s", rt.namespace, rt.name, name, code)
            last = run.last
            deleting = rt.pod["metadata"].get("deletionTimestamp")
            policy = restart_policy(rt.spec)
            if last and not deleting and run.next_start_at > now and should_restart(policy, last):
                msg = f"Back-off restarting failed container {name} in pod {rt.name}"
                self.event(rt.pod, "Warning", "BackOff", msg)

    def container_cgroup(self, rt: PodRuntime, container: str) -> Path | None:
        return cgroups.container_path(self.args.cluster_network, self.args.node, rt.uid, container)

    def kill_all(self, rt: PodRuntime, sig: signal.Signals) -> None:
        for proc in rt.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            cgroups.kill(cgroups.pod_path(self.args.cluster_network, self.args.node, rt.uid))
            for proc in rt.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            self.reap(rt, time.time())

    def terminate(self, rt: PodRuntime, now: float) -> None:
        """Kubelet's delete: SIGTERM, wait the grace period, SIGKILL, then finish the delete."""
        if rt.kill_deadline is None:
            grace = rt.pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = rt.spec.get("terminationGracePeriodSeconds", 30)
            rt.kill_deadline = now + float(grace)
            for proc in rt.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)  # the main process, as kubelet does
            if rt.procs:
                log.info("pod %s/%s: SIGTERM, grace %ss", rt.namespace, rt.name, grace)
                for name in rt.procs:
                    self.event(rt.pod, "Normal", "Killing", f"Stopping container {name}")
                self.timer(float(grace) + 0.05, self.wake.set)
        if rt.procs and now < rt.kill_deadline:
            return
        self.kill_all(rt, signal.SIGKILL)
        self.teardown(rt, remove_dir=False)
        # like kubelet: a deleted pod ends Succeeded only if every container exited 0
        runs = [rt.runs.get(c["name"]) for c in rt.spec.get("containers") or []]
        ok = all(r is not None and r.last is not None and r.last.exit_code == 0 for r in runs)
        rt.phase = "Succeeded" if ok else "Failed"
        with contextlib.suppress(client.ApiException):
            self.post_status(rt, now)
        try:
            self.core.delete_namespaced_pod(
                rt.name,
                rt.namespace,
                body=_body(
                    {
                        "apiVersion": "v1",
                        "kind": "DeleteOptions",
                        "gracePeriodSeconds": 0,
                        "preconditions": {"uid": rt.uid},
                    }
                ),
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
        except client.ApiException as e:
            if e.status not in (404, 409):
                raise
        self.pods.pop(rt.uid, None)
        self.deleted.add(rt.uid)
        shutil.rmtree(rt.dir, ignore_errors=True)
        log.info("pod %s/%s deleted", rt.namespace, rt.name)

    # ---------------------------------------------------------------- status
    def post_status(self, rt: PodRuntime, now: float) -> None:
        if not self.heartbeat or self.lost:
            return
        for name, run in rt.runs.items():
            run.ready = run.running and self.container_ready(rt, name)
        prev = (rt.pod.get("status") or {}).get("conditions") or []
        status = pod_status(
            rt.spec,
            rt.runs,
            phase=rt.phase,
            pod_ip=rt.ip,
            host_ip=HOST_IP,
            start_time=rt.start_time,
            sandbox_ready=rt.sandbox and not rt.torn_down,
            prev_conditions=prev,
            now=now,
        )
        if status == rt.last_status:
            return
        try:
            self.core.patch_namespaced_pod_status(
                rt.name,
                rt.namespace,
                {"status": status},
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
            rt.last_status = status
        except client.ApiException as e:
            if e.status != 404:
                log.warning("status of %s/%s: %s %s", rt.namespace, rt.name, e.reason, e.body)

    # ---------------------------------------------------------------- probes
    def container_ready(self, rt: PodRuntime, name: str) -> bool:
        c = self.container_spec(rt, name)
        if not c.get("readinessProbe"):
            return True
        return rt.runs[name].probe_ok

    def prober_loop(self) -> None:
        while not self.stop.wait(0.5):
            if self.lost:
                continue
            for rt in list(self.pods.values()):
                for name, run in list(rt.runs.items()):
                    if not run.running or rt.torn_down:
                        continue
                    try:
                        c = self.container_spec(rt, name)
                    except KeyError:
                        continue
                    if c.get("readinessProbe"):
                        self.readiness(rt, name, run, c["readinessProbe"])
                    if c.get("livenessProbe"):
                        self.liveness(rt, name, run, c["livenessProbe"])

    def due_probe(self, rt: PodRuntime, key: str, run: ContainerRun, probe: Obj) -> bool | None:
        """Run the probe if its period says so; None when it is not due yet."""
        now = time.time()
        st = rt.probes.get(key)
        if st is None:
            started = run.running_since or now
            st = ProbeState(next_at=started + float(probe.get("initialDelaySeconds") or 0))
            rt.probes[key] = st
        if now < st.next_at:
            return None
        st.next_at = now + float(probe.get("periodSeconds") or 10)
        ok = self.probe_once(rt, run, probe)
        if ok:
            st.successes, st.failures = st.successes + 1, 0
        else:
            st.successes, st.failures = 0, st.failures + 1
        return ok

    def readiness(self, rt: PodRuntime, name: str, run: ContainerRun, probe: Obj) -> None:
        if self.due_probe(rt, name, run, probe) is None:
            return
        st = rt.probes[name]
        if st.successes >= int(probe.get("successThreshold") or 1) and not run.probe_ok:
            run.probe_ok = True
            self.wake.set()
        if st.failures >= int(probe.get("failureThreshold") or 3) and run.probe_ok:
            run.probe_ok = False
            self.wake.set()

    def liveness(self, rt: PodRuntime, name: str, run: ContainerRun, probe: Obj) -> None:
        """A container failing its liveness probe is killed; restartPolicy brings it back.
        (Kubelet would SIGTERM first and wait the grace period; we SIGKILL at once.)"""
        key = f"{name}#liveness"
        if self.due_probe(rt, key, run, probe) is None:
            return
        if rt.probes[key].failures >= int(probe.get("failureThreshold") or 3) and run.pid:
            log.info("pod %s/%s container %s failed liveness", rt.namespace, rt.name, name)
            rt.probes.pop(key, None)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)

    def probe_once(self, rt: PodRuntime, run: ContainerRun, probe: Obj) -> bool:
        timeout = float(probe.get("timeoutSeconds") or 1)
        c = self.container_spec(rt, run.name)
        try:
            if probe.get("tcpSocket"):
                t = probe["tcpSocket"]
                port = probe_port(c, t["port"])
                return network.probe_tcp(rt.netns, t.get("host") or rt.ip, port, timeout)
            if probe.get("httpGet"):
                h = probe["httpGet"]
                host = h.get("host") or rt.ip
                port = probe_port(c, h["port"])
                return network.probe_http(rt.netns, host, port, h.get("path", "/"), timeout)
            if probe.get("exec") and run.pid:
                return self.exec_probe(run.pid, probe["exec"].get("command") or [], timeout)
        except (OSError, ValueError):
            return False
        return False

    def exec_probe(self, pid: int, command: list[str], timeout: float) -> bool:
        """Run the probe command inside the container's namespaces (recorded like any
        process the agent starts, and killed with its group on timeout)."""
        cmd = ["nsenter", "-t", str(pid), "-n", "-m", "-u", "--", *command]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.record_process(proc, f"exec probe in {pid}")
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False

    # ---------------------------------------------------------------- logs
    def lookup_logs(
        self, namespace: str, pod: str, container: str, previous: bool
    ) -> kubelet_server.LogSource | str:
        rt = next(
            (r for r in list(self.pods.values()) if (r.namespace, r.name) == (namespace, pod)),
            None,
        )
        if rt is None:
            return f'pod "{pod}" in namespace "{namespace}" is not running on node {self.node}'
        paths = rt.log_paths.get(container)
        if not paths:
            return f'container "{container}" in pod "{pod}" has not started'
        if previous:
            if len(paths) < 2:
                return f'previous terminated container "{container}" in pod "{pod}" not found'
            return kubelet_server.LogSource(paths[-2], lambda: False)
        path = paths[-1]
        return kubelet_server.LogSource(
            path,
            lambda: (
                bool(rt.log_paths.get(container))
                and rt.log_paths[container][-1] == path
                and container in rt.procs
            ),
        )

    # ---------------------------------------------------------------- faults
    def control_server(self) -> None:
        path = self.state / "control.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(8)
        self.control = srv

        def serve() -> None:
            while not self.stop.is_set():
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=self.control_conn, args=(conn,), daemon=True).start()

        threading.Thread(target=serve, name="control", daemon=True).start()

    def control_conn(self, conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rwb")
            line = f.readline()
            try:
                req = json.loads(line)
                reply: queue.Queue[Obj] = queue.Queue()
                self.requests.put((req, reply))
                self.wake.set()
                resp = reply.get(timeout=60)
            except Exception as e:
                resp = {"ok": False, "error": str(e)}
            f.write(json.dumps(resp).encode() + b"\n")
            f.flush()

    def handle_requests(self) -> None:
        while True:
            try:
                req, reply = self.requests.get_nowait()
            except queue.Empty:
                return
            try:
                reply.put(self.fault(req))
            except Exception as e:
                reply.put({"ok": False, "error": f"{type(e).__name__}: {e}"})

    def find_pod(self, req: Obj) -> PodRuntime | None:
        for rt in self.pods.values():
            if (rt.namespace, rt.name) == (req.get("namespace", "default"), req.get("pod")):
                return rt
        return None

    def fault(self, req: Obj) -> Obj:
        op = req.get("op")
        if op == "ping":
            return {
                "ok": True,
                "node": self.node,
                "pods": [f"{r.namespace}/{r.name}" for r in self.pods.values()],
            }
        if op == "node-ready":
            ready = bool(req.get("ready"))
            if not ready and req.get("report", True):
                with contextlib.suppress(Exception):
                    self.post_node_status("Unknown")
            self.heartbeat = ready
            if ready:
                self.renew_lease()
                self.post_node_status()
                for each in self.pods.values():
                    each.last_status = None
            return {"ok": True, "node": self.node}
        if op == "lose-node":
            self.lost = True
            self.heartbeat = False
            self.api_proxy.close()
            self.service_proxy.close()
            for each in list(self.pods.values()):
                self.kill_all(each, signal.SIGKILL)
                self.teardown(each, remove_dir=False)
            return {"ok": True, "node": self.node}
        rt = self.find_pod(req)
        if rt is None:
            return {
                "ok": False,
                "missing": True,
                "error": f"pod {req.get('pod')} not on {self.node}",
            }
        if op == "kill":
            names = [req["container"]] if req.get("container") else list(rt.procs)
            killed = []
            for name in names:
                proc = rt.procs.get(name)
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
            return {
                "ok": bool(killed),
                "killed": killed,
                "node": self.node,
                **({} if killed else {"error": "no running container matched"}),
            }
        if op == "kill-worker":
            # one training process inside the container (a child of its main process,
            # e.g. of elasticjob-run), not the container: the launcher must notice
            name = req.get("container") or next(iter(rt.procs), "")
            proc = rt.procs.get(name)
            child = procs.newest_worker_child(proc.pid) if proc is not None else None
            if child is None:
                return {"ok": False, "error": f"container {name!r} has no python child process"}
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signal.SIGKILL)
            return {"ok": True, "killed": child[0], "cmdline": child[1], "node": self.node}
        if op == "network":
            up = bool(req.get("up"))
            network.set_pod_network(self.args.cluster_network, rt.uid, up)
            rt.network_cut = not up
            return {"ok": True, "node": self.node}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop every pod (SIGTERM, a short grace, SIGKILL) and remove their netns."""
        log.info("shutting down: stopping %d pods", len(self.pods))
        deadline = time.time()
        for rt in self.pods.values():
            grace = rt.spec.get("terminationGracePeriodSeconds", 30)
            deadline = max(deadline, time.time() + min(float(grace), SHUTDOWN_GRACE_CAP_S))
            for proc in rt.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        while time.time() < deadline and any(
            proc.poll() is None for rt in self.pods.values() for proc in rt.procs.values()
        ):
            time.sleep(0.1)
        for rt in self.pods.values():
            self.kill_all(rt, signal.SIGKILL)
            self.teardown(rt, remove_dir=True)
        self.api_proxy.close()
        self.service_proxy.close()
        with contextlib.suppress(Exception):
            self.log_server.shutdown()
        if self.control is not None:
            self.control.close()
        with contextlib.suppress(FileNotFoundError):
            (self.state / "control.sock").unlink()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elasticjob_devcluster.node_agent")
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--kubelet-port", type=int, required=True)
    p.add_argument("--pod-cidr", required=True)
    p.add_argument("--cluster-network", default="ej-net")
    p.add_argument("--apiserver-port", type=int, required=True)
    p.add_argument(
        "--service-cidr",
        default="10.96.0.0/16",
        help="the API server's --service-cluster-ip-range (clusterIPs the pods can reach)",
    )
    p.add_argument("--ca-file", required=True)
    p.add_argument("--serving-cert", required=True)
    p.add_argument("--serving-key", required=True)
    p.add_argument("--client-ca-file", required=True)
    p.add_argument(
        "--shared-dir",
        default="",
        help="where PersistentVolumeClaim directories live (default: STATE_DIR/../../shared)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.node} %(levelname)s %(message)s",
    )
    if os.geteuid() != 0:
        sys.exit("node_agent: must run as root (it creates network and mount namespaces)")
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)
    agent = Agent(args)

    def on_signal(signum: int, frame: object) -> None:
        agent.stop.set()
        agent.wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.clean_previous_run()
    network.ensure_cluster_network(args.cluster_network)
    while True:
        try:
            agent.register_node()
            break
        except Exception as e:
            if agent.stop.is_set():
                return
            log.warning("registering node %s: %s; retrying", args.node, e)
            time.sleep(1)
    agent.run()


if __name__ == "__main__":
    main()
