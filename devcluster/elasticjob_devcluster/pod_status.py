"""Kubelet's decisions for one pod, as pure functions over what its processes did.

`plan` says which containers to start now (init containers one at a time and in
order, then all the others; restarts honour restartPolicy with a back-off) and
`pod_status` renders the status kubelet would report. The back-off is kubelet's
(first restart at once, then doubling) but shorter so tests stay quick:
1 s doubling to a 10 s cap instead of 10 s to 5 min.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

OWN_CONDITIONS = frozenset(
    {"PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled"}
)
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 10.0


@dataclass(frozen=True)
class Terminated:
    exit_code: int
    reason: str
    started_at: float
    finished_at: float
    container_id: str
    signal: int | None = None
    message: str = ""


@dataclass
class ContainerRun:
    """One container's history on this node (all times are wall-clock seconds)."""

    name: str
    image: str = ""
    starts: int = 0
    running_since: float | None = None
    container_id: str = ""
    pid: int | None = None
    last: Terminated | None = None
    previous: Terminated | None = None
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    next_start_at: float = 0.0
    ready: bool = False
    probe_ok: bool = False
    startup_ok: bool = False  # its startup probe succeeded (liveness and readiness wait)

    @property
    def restart_count(self) -> int:
        return max(0, self.starts - 1)

    @property
    def running(self) -> bool:
        return self.running_since is not None

    def started(self, pid: int, container_id: str, now: float) -> None:
        self.starts += 1
        self.pid = pid
        self.container_id = container_id
        self.running_since = now
        self.probe_ok = False
        self.startup_ok = False
        self.waiting_reason = ""
        self.waiting_message = ""

    def exited(self, exit_code: int, signal: int | None, now: float, start_error: str = "") -> None:
        """Record the end of the current run and when a restart may happen.
        start_error: the command could not be started at all (kubelet's StartError)."""
        started = self.running_since if self.running_since is not None else now
        if signal is not None:
            code = 128 + signal
            reason = "Error"
        else:
            code = exit_code
            reason = "Completed" if exit_code == 0 else "Error"
        if start_error:
            reason = "StartError"
        self.previous = self.last
        self.last = Terminated(code, reason, started, now, self.container_id, signal, start_error)
        self.running_since = None
        self.pid = None
        self.ready = False
        self.probe_ok = False
        self.startup_ok = False
        self.next_start_at = now + backoff_delay(self.restart_count)


def backoff_delay(restart_count: int) -> float:
    """Seconds to wait before the next restart, after `restart_count` restarts so far."""
    if restart_count <= 0:
        return 0.0
    return float(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (restart_count - 1)))


def restart_policy(spec: Obj) -> str:
    return str(spec.get("restartPolicy") or "Always")


def should_restart(policy: str, last: Terminated) -> bool:
    return policy == "Always" or (policy == "OnFailure" and last.exit_code != 0)


@dataclass
class Plan:
    start: list[str] = field(default_factory=list)
    wake_at: float | None = None
    phase: str = "Pending"
    init_done: bool = False


def _names(spec: Obj, key: str) -> list[str]:
    return [str(c["name"]) for c in spec.get(key) or []]


def plan(spec: Obj, runs: Mapping[str, ContainerRun], now: float) -> Plan:
    """Which containers to start now, when to look again, and the pod's phase."""
    policy = restart_policy(spec)
    out = Plan()

    def due(run: ContainerRun) -> bool:
        if now >= run.next_start_at:
            return True
        out.wake_at = min(out.wake_at or run.next_start_at, run.next_start_at)
        return False

    for name in _names(spec, "initContainers"):
        run = runs.get(name) or ContainerRun(name)
        if run.running:
            return out
        if run.last is None:
            out.start.append(name)
            return out
        if run.last.exit_code == 0:
            continue
        if policy == "Never":
            out.phase = "Failed"
            return out
        if due(run):
            out.start.append(name)
        out.phase = "Pending"
        return out
    out.init_done = True

    names = _names(spec, "containers")
    never_started = False
    any_running = False
    will_restart = False
    all_succeeded = True
    for name in names:
        run = runs.get(name) or ContainerRun(name)
        if run.running:
            any_running = True
            continue
        if run.last is None:
            never_started = True
            out.start.append(name)
            continue
        if should_restart(policy, run.last):
            will_restart = True
            if due(run):
                out.start.append(name)
        if run.last.exit_code != 0:
            all_succeeded = False
    if never_started:
        out.phase = "Pending"
    elif any_running or will_restart:
        out.phase = "Running"
    else:
        out.phase = "Succeeded" if all_succeeded else "Failed"
    return out


def duration(seconds: float) -> str:
    """A delay as kubelet's messages print it (Go's time.Duration): 4s, 1m20s, 5m0s."""
    whole = max(0, round(seconds))
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _terminated(t: Terminated) -> Obj:
    out: Obj = {
        "exitCode": t.exit_code,
        "reason": t.reason,
        "startedAt": rfc3339(t.started_at),
        "finishedAt": rfc3339(t.finished_at),
        "containerID": t.container_id,
    }
    if t.signal is not None:
        out["signal"] = t.signal
    if t.message:
        out["message"] = t.message
    return out


def container_status(
    c: Obj, run: ContainerRun, policy: str, pod_terminal: bool, initializing: bool
) -> Obj:
    """One entry of containerStatuses/initContainerStatuses."""
    status: Obj = {
        "name": run.name,
        "image": str(c.get("image") or ""),
        "imageID": "",
        "restartCount": run.restart_count,
        "ready": run.running and run.ready,
        "started": run.running and (run.startup_ok or not c.get("startupProbe")),
        "lastState": {},
    }
    if run.container_id:
        status["containerID"] = run.container_id
    if run.running:
        assert run.running_since is not None
        status["state"] = {"running": {"startedAt": rfc3339(run.running_since)}}
        if run.last is not None:
            status["lastState"] = {"terminated": _terminated(run.last)}
    elif run.last is not None:
        if (not pod_terminal and should_restart(policy, run.last)) or run.waiting_reason:
            reason = run.waiting_reason or "CrashLoopBackOff"
            backoff = duration(run.next_start_at - run.last.finished_at)
            message = run.waiting_message or (
                f"back-off {backoff} restarting failed container={run.name}"
                if reason == "CrashLoopBackOff"
                else ""
            )
            waiting: Obj = {"reason": reason}
            if message:
                waiting["message"] = message
            status["state"] = {"waiting": waiting}
            status["lastState"] = {"terminated": _terminated(run.last)}
        else:
            status["state"] = {"terminated": _terminated(run.last)}
            if run.previous is not None:
                status["lastState"] = {"terminated": _terminated(run.previous)}
    else:
        reason = run.waiting_reason or ("PodInitializing" if initializing else "ContainerCreating")
        waiting = {"reason": reason}
        if run.waiting_message:
            waiting["message"] = run.waiting_message
        status["state"] = {"waiting": waiting}
    return status


def _condition(
    ctype: str, ok: bool, prev: Mapping[str, Obj], now: float, reason: str = "", message: str = ""
) -> Obj:
    status = "True" if ok else "False"
    old = prev.get(ctype)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == status and old.get("lastTransitionTime")
        else rfc3339(now)
    )
    cond: Obj = {"type": ctype, "status": status, "lastTransitionTime": since}
    cond["lastProbeTime"] = None
    if not ok and reason:
        cond["reason"] = reason
    if not ok and message:
        cond["message"] = message
    return cond


def pod_status(
    spec: Obj,
    runs: Mapping[str, ContainerRun],
    *,
    phase: str,
    pod_ip: str,
    host_ip: str,
    start_time: float,
    sandbox_ready: bool,
    prev_conditions: Sequence[Obj],
    now: float,
) -> Obj:
    """The status object kubelet would post for this pod."""
    policy = restart_policy(spec)
    init_policy = "OnFailure" if policy == "Always" else policy
    terminal = phase in ("Succeeded", "Failed")
    prev = {str(c.get("type")): c for c in prev_conditions}
    inits = spec.get("initContainers") or []
    containers = spec.get("containers") or []
    init_status = [
        container_status(
            c, runs.get(c["name"]) or ContainerRun(c["name"]), init_policy, terminal, False
        )
        for c in inits
    ]
    incomplete = [
        c["name"]
        for c in inits
        if (r := runs.get(c["name"])) is None or r.last is None or r.last.exit_code != 0
    ]
    initialized = not incomplete
    statuses = [
        container_status(
            c, runs.get(c["name"]) or ContainerRun(c["name"]), policy, terminal, not initialized
        )
        for c in containers
    ]
    unready = [s["name"] for s in statuses if not s["ready"]]
    ready = not unready and not terminal
    gates = [str(g["conditionType"]) for g in spec.get("readinessGates") or []]
    closed = [g for g in gates if (prev.get(g) or {}).get("status") != "True"]
    gates_ok = not closed
    if terminal:
        ready_reason, ready_msg = "PodCompleted", ""
    elif ready and closed:
        ready_reason = "ReadinessGatesNotReady"
        ready_msg = f"corresponding condition of pod readiness gate {closed[0]!r} does not exist."
    else:
        ready_reason = "ContainersNotReady"
        ready_msg = f"containers with unready status: [{' '.join(unready)}]"
    conditions = [
        _condition("PodReadyToStartContainers", sandbox_ready and not terminal, prev, now),
        _condition(
            "Initialized",
            initialized,
            prev,
            now,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(incomplete)}]",
        ),
        _condition("Ready", ready and gates_ok, prev, now, ready_reason, ready_msg),
        _condition("ContainersReady", ready, prev, now, ready_reason, ready_msg),
        _condition("PodScheduled", True, prev, now),
    ]
    # conditions others own (readiness gates, DisruptionTarget, ...) are kept as they are
    conditions += [c for t, c in prev.items() if t not in OWN_CONDITIONS]
    status: Obj = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": rfc3339(start_time),
        "containerStatuses": statuses,
    }
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if inits:
        status["initContainerStatuses"] = init_status
    return status


def status_patch(pod: Obj, status: Obj) -> Obj:
    """The merge patch that sets ``status`` on ``pod`` as it was read. A merge patch
    replaces the conditions list whole, so it names the resourceVersion read: the API
    server refuses it (409) if another writer changed the pod since, rather than drop a
    condition that writer added (an eviction's DisruptionTarget: the operator would
    count a drained worker failed)."""
    return {"metadata": {"resourceVersion": pod["metadata"]["resourceVersion"]}, "status": status}
