"""The devcluster's node agent: plays kubelet for one Node by running pods as processes.

One OS process per Node. This module wires the parts together and reconciles pods;
each part is a module of its own, handed a NodeContext (node_context.py) rather than
the Agent:

    informers.py    list+watch pods, Services, Nodes, claims and volumes into a cache
    node_status.py  register the Node; its status, Lease and the heartbeat thread
    binder.py       bind pending pods this node picks (scheduling.py decides)
    provisioner.py  a hostPath PV for every pending claim (leader node only)
    sandbox.py      a pod's netns and IP (network.py), /etc/hosts (hosts.py), /dev/shm
    pod_volumes.py  its volumes (volumes.py writes them) and each container's mounts
    containers.py   start (container_images.py, container_spec.py, container_init.py),
                    logs, reap, kill
    probes.py       readiness and liveness probes
    events.py       kubelet-style Events
    control.py      the control socket tests inject faults through (faults.py)
    kubelet_server.py  `kubectl logs`

A pod's life: bind it, create its sandbox, start its containers as plan() says
(pod_status.py: init containers in order, restartPolicy with back-off), report its
status, and on deletion SIGTERM, wait the grace period, SIGKILL its cgroup (cgroups.py:
everything it started, whatever its session) and complete the delete. Services'
clusterIPs are relayed by this agent (services.py, network.Proxy), 10.96.0.1:443 to
the API server, which pods find through KUBERNETES_SERVICE_HOST/PORT.

Threads: informer threads fill the cache and wake the single reconcile loop (`run`),
which owns all pod state; the heartbeat, prober, events, control socket and log server
threads only read it, or hand requests over through a queue (control socket, events).
The prober also keeps its probe counters in each pod's runtime and flips readiness.

What a real kubelet does that this does not: pull images (the command runs from this
repo's Python environment; container_images.py knows the ENTRYPOINT of the project's images for a
container without one), resource limits (so no OOMKilled), exec/attach/
port-forward, startup probes, preStop hooks, UDP Services and service env for
hostNetwork pods' clusterIPs. Restart back-off is 1 s doubling to 10 s. At agent
shutdown pods get at most 5 s of grace.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from elasticjob_devcluster import (
    cgroups,
    containers,
    informers,
    kubelet_server,
    network,
    node_status,
    pod_volumes,
    procs,
    provisioner,
    sandbox,
    scheduling,
    services,
    volumes,
)
from elasticjob_devcluster.binder import Binder
from elasticjob_devcluster.control import SOCKET_NAME, ControlServer, Op, Reply, Request
from elasticjob_devcluster.events import EventRecorder
from elasticjob_devcluster.kubeapi import (
    MERGE_PATCH,
    TIMEOUT,
    ApiException,
    Obj,
    body,
    new_client,
    raw,
)
from elasticjob_devcluster.node_context import HOST_IP, Link, NodeContext
from elasticjob_devcluster.pod_runtime import PodRuntime
from elasticjob_devcluster.pod_status import ContainerRun, plan, pod_status, status_patch
from elasticjob_devcluster.probes import Prober, container_ready

log = logging.getLogger("elasticjob_devcluster.node_agent")

SHUTDOWN_GRACE_CAP_S = 5.0
FINISHED = ("Succeeded", "Failed")


def path_env() -> str:
    """The agent's PATH for the pods, with this venv's bin on it (first, unless the
    agent's PATH already places it, e.g. after the cluster's own etcd 3.6 bin dir)."""
    venv_bin = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
    return os.pathsep.join(parts if venv_bin in parts else [venv_bin, *parts])


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        state = Path(args.state_dir).resolve()
        api = new_client(config_file=args.kubeconfig)
        self.core = client.CoreV1Api(api)
        link = Link()
        capacity = node_status.machine_capacity()
        self.ctx = NodeContext(
            node=args.node,
            cluster=args.cluster_network,
            service_cidr=args.service_cidr,
            state=state,
            shared=Path(args.shared_dir or state.parent.parent / "shared").resolve(),
            core=self.core,
            wake=threading.Event(),
            stop=threading.Event(),
            link=link,
            records=procs.RecordFile(state / "processes.json"),
            events=EventRecorder(self.core, args.node, link),
            capacity=capacity,
            ca_pem=Path(args.ca_file).read_text(),
            path_env=path_env(),
            kube_ip=str(ipaddress.ip_network(args.service_cidr)[1]),
            apiserver_port=args.apiserver_port,
        )
        self.reporter = node_status.NodeReporter(
            self.core,
            client.CoordinationV1Api(api),
            args.node,
            args.pod_cidr,
            args.kubelet_port,
            capacity,
            link,
        )
        self.cache = informers.Cache()
        self.binder = Binder(self.ctx)
        self.pods: dict[str, PodRuntime] = {}  # by uid; owned by the reconcile loop
        self.prober = Prober(self.ctx, lambda: list(self.pods.values()))
        self.control = ControlServer(state / SOCKET_NAME, self.ctx.wake)
        self.deleted: set[str] = set()  # uids whose delete we completed (the watch may lag)
        self.hosts_dirty = True  # pods or Services changed: hosts files and relays follow
        self.net = ipaddress.ip_network(args.pod_cidr)
        self.log_server: Any = None
        # clusterIPs live in the cluster netns: the API server's (relayed to the host's
        # loopback) and every Service's (relayed to ready pods over the bridge)
        self.api_proxy = network.Proxy(args.cluster_network, dial_ns="")
        self.service_proxy = network.Proxy(args.cluster_network, dial_ns=args.cluster_network)

    # ---------------------------------------------------------------- setup
    def clean_previous_run(self) -> None:
        """Reap what an earlier incarnation of this agent left (it may have been killed)."""
        state = self.ctx.state
        procs.stop(procs.load_records(self.ctx.records.path), grace_seconds=1)
        cgroups.kill(cgroups.node_path(self.ctx.cluster, self.ctx.node))
        procs.save_records(self.ctx.records.path, [])
        network.delete_node_pods_netns(state, self.ctx.cluster)
        volumes.unmount_under(state / "pods")
        shutil.rmtree(state / "pods", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.control.path.unlink()

    def register_node(self) -> None:
        self.reporter.register()

    def changed(self, kind: str) -> None:
        """An informer saw `kind` change: wake the reconcile loop."""
        if kind in ("pods", "services"):
            self.hosts_dirty = True
        self.ctx.wake.set()

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        stop, wake = self.ctx.stop, self.ctx.wake
        informers.start(
            self.cache,
            {
                "pods": self.core.list_pod_for_all_namespaces,
                "services": self.core.list_service_for_all_namespaces,
                "nodes": self.core.list_node,
                "pvcs": self.core.list_persistent_volume_claim_for_all_namespaces,
                "pvs": self.core.list_persistent_volume,
            },
            self.changed,
            stop,
        )
        for name, target in (
            ("heartbeat", lambda: self.reporter.heartbeat_loop(stop)),
            ("events", lambda: self.ctx.events.post_loop(stop)),
            ("prober", self.prober.loop),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()
        self.control.start(stop)
        network.route_services(self.ctx.cluster, self.ctx.service_cidr)
        self.api_proxy.set_routes({(self.ctx.kube_ip, 443): [(HOST_IP, self.args.apiserver_port)]})
        self.log_server = kubelet_server.serve(
            self.args.kubelet_port,
            Path(self.args.serving_cert),
            Path(self.args.serving_key),
            Path(self.args.client_ca_file),
            self.lookup_logs,
        )
        while not stop.is_set():
            wake.wait(timeout=1.0)
            wake.clear()
            self.control.handle_pending(self.fault)
            if stop.is_set():
                break
            if not self.cache.all_synced():
                continue
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile failed")
                time.sleep(0.5)
        self.shutdown()

    def reconcile(self) -> None:
        if self.ctx.link.lost:
            return
        pods, nodes = self.cache.items("pods"), self.cache.items("nodes")
        self.binder.schedule(pods, nodes)
        if self.ctx.link.heartbeat and scheduling.leader(nodes) == self.ctx.node:
            provisioner.provision(self.ctx, self.cache)
        mine = {
            p["metadata"]["uid"]: p
            for p in pods
            if (p.get("spec") or {}).get("nodeName") == self.ctx.node
        }
        self.deleted &= set(mine)
        for uid, pod in mine.items():
            if uid in self.deleted:
                continue
            rt = self.pods.get(uid)
            if rt is None:
                phase = (pod.get("status") or {}).get("phase")
                if phase in FINISHED and not pod["metadata"].get("deletionTimestamp"):
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
                containers.kill_pod(self.ctx, gone)
                sandbox.teardown(self.ctx, gone, remove_dir=True)
        if self.hosts_dirty:
            self.hosts_dirty = False
            self.sync_service_proxy()
            pods, svcs = self.cache.items("pods"), self.cache.items("services")
            for rt in self.pods.values():
                sandbox.write_hosts(rt, pods, svcs)

    def admit(self, pod: Obj) -> PodRuntime:
        m = pod["metadata"]
        rt = PodRuntime(
            m["uid"], m["namespace"], m["name"], self.ctx.state / "pods" / m["uid"], pod
        )
        rt.dir.mkdir(parents=True, exist_ok=True)
        prev = pod.get("status") or {}
        # carry restart counts over from the API (an agent restart is not a pod restart)
        for cs in (prev.get("containerStatuses") or []) + (prev.get("initContainerStatuses") or []):
            if cs.get("restartCount"):
                rt.runs[cs["name"]] = ContainerRun(cs["name"], starts=int(cs["restartCount"]) + 1)
        self.pods[rt.uid] = rt
        return rt

    def next_ip(self) -> str:
        used = {rt.ip for rt in self.pods.values() if rt.netns and not rt.torn_down}
        return sandbox.free_ip(self.net, used)

    def sync_pod(self, rt: PodRuntime) -> None:
        now = time.time()
        containers.reap(self.ctx, rt, now)
        if rt.pod["metadata"].get("deletionTimestamp"):
            if containers.stop_for_delete(self.ctx, rt, now):
                self.finish_delete(rt, now)
            return
        if rt.phase not in FINISHED:
            if not rt.sandbox:
                pods, svcs = self.cache.items("pods"), self.cache.items("services")
                sandbox.create(self.ctx, rt, self.next_ip, pods, svcs)
                self.hosts_dirty = True
                # publish the pod IP before the containers start, so peers' hosts files
                # (hostname.subdomain of headless Services) have it as early as possible
                self.post_status(rt, now)
            pod_volumes.refresh_tokens(self.ctx, rt, now)
            for name in plan(rt.spec, rt.runs, now).start:
                containers.start(self.ctx, rt, name, now, self.cache.items("services"))
            p = plan(rt.spec, rt.runs, now)
            rt.phase = p.phase
            if p.wake_at is not None:
                self.ctx.wake_in(max(0.05, p.wake_at - now))
            if rt.phase in FINISHED:
                containers.kill_pod(self.ctx, rt)
                sandbox.teardown(self.ctx, rt, remove_dir=False)
        self.post_status(rt, now)

    def finish_delete(self, rt: PodRuntime, now: float) -> None:
        """The containers are gone: report the last status, delete the pod object (with
        grace 0, for exactly this pod) and forget it."""
        sandbox.teardown(self.ctx, rt, remove_dir=False)
        # like kubelet: a deleted pod ends Succeeded only if every container exited 0
        runs = [rt.runs.get(c["name"]) for c in rt.spec.get("containers") or []]
        ok = all(r is not None and r.last is not None and r.last.exit_code == 0 for r in runs)
        rt.phase = "Succeeded" if ok else "Failed"
        with contextlib.suppress(ApiException):
            self.post_status(rt, now)
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": rt.uid},
        }
        try:
            self.core.delete_namespaced_pod(
                rt.name,
                rt.namespace,
                body=body(options),
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
        except ApiException as e:
            if e.status not in (404, 409):
                raise
        self.pods.pop(rt.uid, None)
        self.deleted.add(rt.uid)
        shutil.rmtree(rt.dir, ignore_errors=True)
        log.info("pod %s/%s deleted", rt.namespace, rt.name)

    def post_status(self, rt: PodRuntime, now: float) -> None:
        """Patch the pod's status on the pod as last read (``status_patch``): a patch from
        a stale read is refused (409), the pod is read again past the cache and the
        status recomputed once; a later conflict waits for the next pass."""
        if not self.ctx.link.up:
            return
        for name, run in rt.runs.items():
            run.ready = run.running and container_ready(rt, name)
        for attempt in range(2):
            status = self.status_of(rt, now)
            if status == rt.last_status:
                return
            try:
                self.core.patch_namespaced_pod_status(
                    rt.name,
                    rt.namespace,
                    status_patch(rt.pod, status),
                    _content_type=MERGE_PATCH,
                    _preload_content=False,
                    _request_timeout=TIMEOUT,
                )
                rt.last_status = status
                return
            except ApiException as e:
                if e.status == 409 and attempt == 0 and self.reread(rt):
                    continue
                if e.status not in (404, 409):
                    log.warning("status of %s/%s: %s %s", rt.namespace, rt.name, e.reason, e.body)
                return

    def status_of(self, rt: PodRuntime, now: float) -> Obj:
        prev = (rt.pod.get("status") or {}).get("conditions") or []
        return pod_status(
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

    def reread(self, rt: PodRuntime) -> bool:
        """Read the pod from the API server, past the cache; False if it is gone."""
        try:
            pod = raw(
                self.core.read_namespaced_pod(
                    rt.name, rt.namespace, _preload_content=False, _request_timeout=TIMEOUT
                )
            )
        except ApiException:
            return False
        if pod["metadata"].get("uid") != rt.uid:
            return False  # a replacement took the name
        rt.pod = pod
        return True

    def sync_service_proxy(self) -> None:
        if self.ctx.link.lost:
            return
        table = services.proxy_table(self.cache.items("services"), self.cache.items("pods"))
        table.pop((self.ctx.kube_ip, 443), None)
        self.service_proxy.set_routes(table)

    def find_pod(self, namespace: str, name: str) -> PodRuntime | None:
        for rt in list(self.pods.values()):
            if (rt.namespace, rt.name) == (namespace, name):
                return rt
        return None

    def lookup_logs(
        self, namespace: str, pod: str, container: str, previous: bool
    ) -> kubelet_server.LogSource | str:
        """For the log server's threads: where a container's log is (or why not)."""
        rt = self.find_pod(namespace, pod)
        if rt is None:
            return f'pod "{pod}" in namespace "{namespace}" is not running on node {self.ctx.node}'
        return containers.log_source(rt, container, previous)

    # ---------------------------------------------------------------- faults
    def fault(self, req: Request) -> Reply:
        """Carry out a control request (on the reconcile loop, which owns the pods)."""
        node = self.ctx.node
        if req.op == Op.PING:
            return Reply(
                ok=True, node=node, pods=[f"{r.namespace}/{r.name}" for r in self.pods.values()]
            )
        if req.op == Op.NODE_READY:
            self.reporter.set_ready(req.ready, req.report)
            for each in self.pods.values() if req.ready else ():
                each.last_status = None  # back: report every pod afresh
            return Reply(ok=True, node=node)
        if req.op == Op.LOSE_NODE:
            self.lose()
            return Reply(ok=True, node=node)
        rt = self.find_pod(req.namespace, req.pod)
        if rt is None:
            return Reply(ok=False, node=node, missing=True, error=f"pod {req.pod} not on {node}")
        try:
            if req.op == Op.KILL:
                killed = containers.kill(rt, req.container)
                error = "" if killed else "no running container matched"
                return Reply(ok=bool(killed), node=node, pids=killed, error=error)
            if req.op == Op.KILL_WORKER:
                pid, cmdline = containers.kill_worker(rt, req.container)
                return Reply(ok=True, node=node, pids=[pid], cmdline=cmdline)
            if req.op == Op.FREEZE_WORKER:
                pid, cmdline = containers.freeze_worker(rt, req.container)
                return Reply(ok=True, node=node, pids=[pid], cmdline=cmdline)
            if req.op == Op.FREEZE:
                return Reply(ok=True, node=node, pids=[containers.freeze(rt, req.container)])
            if req.op == Op.THAW:
                return Reply(ok=True, node=node, pids=[containers.thaw(rt, req.container)])
        except containers.ContainerError as e:
            return Reply(ok=False, node=node, error=str(e))
        if req.op == Op.NETWORK:
            network.set_pod_network(self.ctx.cluster, rt.uid, req.up, self.ctx.service_cidr)
            rt.network_cut = not req.up
            return Reply(ok=True, node=node)
        return Reply(ok=False, node=node, error=f"op {req.op.value!r} is not handled")

    def lose(self) -> None:
        """The machine dies: its pods with it, and it never talks to anyone again."""
        self.ctx.link.lost = True
        self.ctx.link.heartbeat = False
        self.api_proxy.close()
        self.service_proxy.close()
        for rt in list(self.pods.values()):
            containers.kill_pod(self.ctx, rt)
            sandbox.teardown(self.ctx, rt, remove_dir=False)

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop every pod (SIGTERM, a short grace, SIGKILL) and remove their netns."""
        log.info("shutting down: stopping %d pods", len(self.pods))
        deadline = time.time()
        for rt in self.pods.values():
            grace = float(rt.spec.get("terminationGracePeriodSeconds", 30))
            deadline = max(deadline, time.time() + min(grace, SHUTDOWN_GRACE_CAP_S))
            containers.sigterm(rt)
        while time.time() < deadline and any(
            proc.poll() is None for rt in self.pods.values() for proc in rt.procs.values()
        ):
            time.sleep(0.1)
        for rt in self.pods.values():
            containers.kill_pod(self.ctx, rt)
            sandbox.teardown(self.ctx, rt, remove_dir=True)
        self.api_proxy.close()
        self.service_proxy.close()
        with contextlib.suppress(Exception):
            self.log_server.shutdown()
        self.control.close()


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
        agent.ctx.stop.set()
        agent.ctx.wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.clean_previous_run()
    network.ensure_cluster_network(args.cluster_network)
    while True:
        try:
            agent.register_node()
            break
        except Exception as e:
            if agent.ctx.stop.is_set():
                return
            log.warning("registering node %s: %s; retrying", args.node, e)
            time.sleep(1)
    agent.run()


if __name__ == "__main__":
    main()
