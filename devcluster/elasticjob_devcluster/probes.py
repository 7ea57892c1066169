"""Startup, readiness and liveness probes: tcpSocket, httpGet and exec, as kubelet runs them.

One prober thread looks at every running container twice a second and runs each probe
its period makes due (from the pod's netns; exec inside the container's namespaces).
A container with a startup probe gets no other probe until that one succeeded once;
failing its threshold first kills it as liveness does. Readiness flips the container's
Ready (then wakes the reconcile loop to report it); liveness failing its threshold
SIGKILLs the container's process group, and its restartPolicy decides what follows
(kubelet would SIGTERM first and wait the grace period). A container whose process is
stopped (the freeze fault) still answers a TCP connect from the kernel, but not an HTTP
request or an exec probe that checks it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticjob_devcluster import network
from elasticjob_devcluster.kubeapi import Obj
from elasticjob_devcluster.node_context import NodeContext
from elasticjob_devcluster.pod_status import ContainerRun

if TYPE_CHECKING:
    from elasticjob_devcluster.pod_runtime import PodRuntime

log = logging.getLogger("elasticjob_devcluster.probes")

PROBER_PERIOD_S = 0.5
LIVENESS = "#liveness"  # suffix of a liveness probe's key (readiness: the container name)
STARTUP = "#startup"  # suffix of a startup probe's key


@dataclass
class ProbeState:
    next_at: float
    successes: int = 0  # in a row
    failures: int = 0  # in a row

    def record(self, ok: bool) -> None:
        if ok:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1


def probe_port(container: Obj, port: int | str) -> int:
    """A probe's port, by number or by the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def readiness_after(st: ProbeState, probe: Obj, ready: bool) -> bool:
    """The container's readiness once the probe's thresholds have had their say."""
    if st.successes >= int(probe.get("successThreshold") or 1):
        return True
    if st.failures >= int(probe.get("failureThreshold") or 3):
        return False
    return ready


def liveness_failed(st: ProbeState, probe: Obj) -> bool:
    return st.failures >= int(probe.get("failureThreshold") or 3)


def startup_verdict(st: ProbeState, probe: Obj) -> bool | None:
    """True once the startup probe succeeded (kubelet takes one success), False once it
    failed its threshold (the container is killed), None while it is still trying."""
    if st.successes >= 1:
        return True
    if st.failures >= int(probe.get("failureThreshold") or 3):
        return False
    return None


def container_ready(rt: PodRuntime, name: str) -> bool:
    """Ready as far as probes go: no readiness probe, or its last verdict was success."""
    if not rt.container(name).get("readinessProbe"):
        return True
    return rt.runs[name].probe_ok


class Prober:
    def __init__(self, ctx: NodeContext, pods: Callable[[], list[PodRuntime]]) -> None:
        self.ctx = ctx
        self.pods = pods

    def loop(self) -> None:
        while not self.ctx.stop.wait(PROBER_PERIOD_S):
            if self.ctx.link.lost:
                continue
            for rt in self.pods():
                for name, run in list(rt.runs.items()):
                    if not run.running or rt.torn_down:
                        continue
                    try:
                        c = rt.container(name)
                    except KeyError:
                        continue
                    if c.get("startupProbe") and not run.startup_ok:
                        self.startup(rt, name, run, c["startupProbe"])
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
        st.record(ok)
        return ok

    def readiness(self, rt: PodRuntime, name: str, run: ContainerRun, probe: Obj) -> None:
        if self.due_probe(rt, name, run, probe) is None:
            return
        ready = readiness_after(rt.probes[name], probe, run.probe_ok)
        if ready != run.probe_ok:
            run.probe_ok = ready
            self.ctx.wake.set()

    def startup(self, rt: PodRuntime, name: str, run: ContainerRun, probe: Obj) -> None:
        """Until it succeeds once, the container's only probe; its threshold failed, the
        container is killed as a failed liveness probe kills it."""
        key = name + STARTUP
        if self.due_probe(rt, key, run, probe) is None:
            return
        verdict = startup_verdict(rt.probes[key], probe)
        if verdict:
            run.startup_ok = True
            rt.probes.pop(key, None)
            self.ctx.wake.set()  # containerStatuses' started flips
        elif verdict is False:
            self.kill(rt, name, run, key, "startup")

    def liveness(self, rt: PodRuntime, name: str, run: ContainerRun, probe: Obj) -> None:
        """A container failing its liveness probe is killed; restartPolicy brings it back."""
        key = name + LIVENESS
        if self.due_probe(rt, key, run, probe) is None:
            return
        if liveness_failed(rt.probes[key], probe):
            self.kill(rt, name, run, key, "liveness")

    def kill(self, rt: PodRuntime, name: str, run: ContainerRun, key: str, probe: str) -> None:
        if not run.pid:
            return
        log.info("pod %s/%s container %s failed %s", rt.namespace, rt.name, name, probe)
        rt.probes.pop(key, None)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # a stopped process dies of it too

    def probe_once(self, rt: PodRuntime, run: ContainerRun, probe: Obj) -> bool:
        timeout = float(probe.get("timeoutSeconds") or 1)
        c = rt.container(run.name)
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
        self.ctx.records.add(proc, f"exec probe in {pid}")
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False
