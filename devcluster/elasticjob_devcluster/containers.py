"""A pod's containers as processes: start, log capture, reap, stop, and the pod faults.

A start writes the container's ContainerSpec and runs container_init on it, in a
session of its own (so its pid is its process group) with stdout and stderr pumped
into a CRI-format log file per start. Reaping records the exit; stopping SIGKILLs the
container's process group and then its cgroup (cgroups.py: also what it started in
sessions of its own). Deletion is kubelet's: SIGTERM to the main process, the grace
period, then SIGKILL. A stopped (frozen) process keeps its SIGTERM pending, so a frozen
container is deleted at the end of its grace period, as on a real node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from elasticjob_devcluster import (
    cgroups,
    container_images,
    kubelet_server,
    logs,
    network,
    pod_volumes,
    procs,
)
from elasticjob_devcluster.container_spec import ContainerSpec, error_path
from elasticjob_devcluster.kubeapi import ApiException, Obj
from elasticjob_devcluster.node_context import HOST_IP, NodeContext
from elasticjob_devcluster.pod_env import (
    EnvError,
    PodContext,
    expand_command,
    pod_hostname,
    resolve_env,
    runtime_env,
)
from elasticjob_devcluster.pod_runtime import PodRuntime
from elasticjob_devcluster.pod_status import ContainerRun, restart_policy, should_restart
from elasticjob_devcluster.probes import LIVENESS, STARTUP
from elasticjob_devcluster.services import service_env
from elasticjob_devcluster.volumes import VolumeError

log = logging.getLogger("elasticjob_devcluster.containers")

CONFIG_RETRY_S = 2.0  # a container whose config cannot be resolved is tried again after
KILL_WAIT_S = 5.0


class ContainerError(RuntimeError):
    """A fault asked for a container that does not run."""


def container_spec(
    ctx: NodeContext,
    rt: PodRuntime,
    c: Obj,
    services: list[Obj],
    image: container_images.Image | None,
) -> ContainerSpec:
    """Everything container_init needs for `c`: its env, argv (with `image`'s entrypoint
    if it has no command) and mounts resolved from the pod and the objects it refers to
    (volumes written first, if not yet)."""
    cms, secrets = pod_volumes.referenced(ctx, rt)
    if not rt.volumes_ready:
        pod_volumes.prepare(ctx, rt, cms, secrets)
    base = runtime_env(
        rt.pod,
        service_env(services, rt.namespace),
        ctx.path_env,
        str(rt.home),
        ctx.kube_ip,
        HOST_IP,
        ctx.apiserver_port,
    )
    env = resolve_env(rt.pod, c, PodContext(rt.ip, HOST_IP, ctx.capacity), cms, secrets, base)
    argv = expand_command(c, env, image)
    mounts = pod_volumes.container_mounts(ctx, rt, c)
    return ContainerSpec(
        netns=str(network.NETNS_DIR / rt.netns) if rt.netns else "",
        hostname=pod_hostname(rt.pod),
        hosts_file=str(rt.hosts_path),
        mounts=tuple(mounts),
        working_dir=str(c.get("workingDir") or ""),
        argv=tuple(argv),
        env=env,
        cgroup=str(ctx.container_cgroup(rt.uid, c["name"]) or ""),
    )


def start(ctx: NodeContext, rt: PodRuntime, name: str, now: float, services: list[Obj]) -> None:
    """Start container `name`, as kubelet does: its image first (container_images.py), then its
    config (env, volumes), then the process; a step that fails leaves it waiting with
    kubelet's reason and is tried again CONFIG_RETRY_S later."""
    c = rt.container(name)
    run = rt.runs.setdefault(name, ContainerRun(name, image=str(c.get("image") or "")))
    if now < run.next_start_at:
        return  # a failed step's retry, or a restart's back-off, is not due yet
    try:
        image = container_images.pull(c)
    except container_images.ImageError as e:
        image_failed(ctx, rt, run, str(c.get("image") or ""), e, now)
        return
    try:
        spec = container_spec(ctx, rt, c, services, image)
    except (EnvError, VolumeError, ApiException, OSError) as e:
        if run.waiting_reason != "CreateContainerConfigError":
            ctx.events.event(rt.pod, "Warning", "Failed", f"Error: {e}")
        run.waiting_reason = "CreateContainerConfigError"
        run.waiting_message = str(e)[:500]
        run.next_start_at = now + CONFIG_RETRY_S
        ctx.wake_in(CONFIG_RETRY_S)
        log.warning("pod %s/%s container %s: %s", rt.namespace, rt.name, name, e)
        return
    rt.home.mkdir(exist_ok=True)
    n = run.starts
    spec_path = rt.spec_file(name, n)
    spec.write(spec_path)
    log_path = rt.log_file(name, n)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.touch()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticjob_devcluster.container_init", str(spec_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        cwd="/",
        env={"PATH": ctx.path_env},
    )
    ctx.records.add(proc, f"pod {rt.namespace}/{rt.name} container {name} #{n}")
    rt.procs[name] = proc
    rt.log_paths.setdefault(name, []).append(log_path)
    run.started(proc.pid, f"devcluster://{rt.uid}/{name}/{n}", now)
    rt.probes.pop(name, None)
    rt.probes.pop(name + LIVENESS, None)
    rt.probes.pop(name + STARTUP, None)
    pump_logs(proc, log_path)
    threading.Thread(target=_wake_on_exit, args=(proc, ctx.wake), daemon=True).start()
    log.info("pod %s/%s container %s started pid %d", rt.namespace, rt.name, name, proc.pid)
    ctx.events.event(rt.pod, "Normal", "Started", f"Started container {name}")


def image_failed(
    ctx: NodeContext,
    rt: PodRuntime,
    run: ContainerRun,
    ref: str,
    e: container_images.ImageError,
    now: float,
) -> None:
    """The image step failed: wait with kubelet's reason (ErrImagePull, then
    ImagePullBackOff; InvalidImageName) and its events on each change, retry later."""
    reason, message = container_images.after_failure(run.waiting_reason, e, ref)
    if reason != run.waiting_reason:
        if reason == container_images.IMAGE_PULL_BACKOFF:
            ctx.events.event(rt.pod, "Normal", "BackOff", message)
        elif reason == container_images.INVALID_IMAGE_NAME:
            ctx.events.event(rt.pod, "Warning", "InspectFailed", message)
        else:
            pulling = f'Failed to pull image "{ref}": {message}'
            ctx.events.event(rt.pod, "Warning", "Failed", pulling)
        ctx.events.event(rt.pod, "Warning", "Failed", f"Error: {reason}")
        log.warning("pod %s/%s container %s: %s", rt.namespace, rt.name, run.name, message)
    run.waiting_reason = reason
    run.waiting_message = message[:500]
    run.next_start_at = now + CONFIG_RETRY_S
    ctx.wake_in(CONFIG_RETRY_S)


def pump_logs(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Copy the process's stdout and stderr into `log_path` in CRI format, one thread
    each; the last to reach end of file closes it."""
    out = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed by the last reader
    lock = threading.Lock()
    remaining = [2]

    def pump(stream: IO[bytes], label: str) -> None:
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

    for stream, label in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        assert stream is not None  # both are pipes
        threading.Thread(target=pump, args=(stream, label), daemon=True).start()


def _wake_on_exit(proc: subprocess.Popen[bytes], wake: threading.Event) -> None:
    proc.wait()
    wake.set()


def reap(ctx: NodeContext, rt: PodRuntime, now: float) -> None:
    """Record the exit of every container process that ended, and clean up after it."""
    for name, proc in list(rt.procs.items()):
        code = proc.poll()
        if code is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the main process left behind
        cgroups.kill(ctx.container_cgroup(rt.uid, name))  # also in sessions of their own
        del rt.procs[name]
        run = rt.runs[name]
        start_error = ""
        with contextlib.suppress(OSError):
            start_error = error_path(rt.spec_file(name, run.starts - 1)).read_text()
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
            ctx.events.event(rt.pod, "Warning", "BackOff", msg)


def kill_pod(ctx: NodeContext, rt: PodRuntime) -> None:
    """SIGKILL every container of the pod and everything they started, then reap them."""
    for proc in rt.procs.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    cgroups.kill(ctx.pod_cgroup(rt.uid))
    for proc in rt.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_WAIT_S)
    reap(ctx, rt, time.time())


def sigterm(rt: PodRuntime) -> None:
    """SIGTERM each container's main process, as kubelet does (not its group)."""
    for proc in rt.procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)


def grace_period(rt: PodRuntime) -> float:
    grace = rt.pod["metadata"].get("deletionGracePeriodSeconds")
    if grace is None:
        grace = rt.spec.get("terminationGracePeriodSeconds", 30)
    return float(grace)


def stop_for_delete(ctx: NodeContext, rt: PodRuntime, now: float) -> bool:
    """Kubelet's delete, one step per call: SIGTERM, then (once every container exited,
    or the grace period is over) SIGKILL what is left. True when the pod is stopped."""
    if rt.kill_deadline is None:
        grace = grace_period(rt)
        rt.kill_deadline = now + grace
        sigterm(rt)
        if rt.procs:
            log.info("pod %s/%s: SIGTERM, grace %ss", rt.namespace, rt.name, grace)
            for name in rt.procs:
                ctx.events.event(rt.pod, "Normal", "Killing", f"Stopping container {name}")
            ctx.wake_in(grace + 0.05)
    if rt.procs and now < rt.kill_deadline:
        return False
    kill_pod(ctx, rt)
    return True


# -- pod faults (control.py), carried out by the reconcile loop


def _chosen(rt: PodRuntime, container: str) -> str:
    """The named container, or the first running one for ""."""
    return container or next(iter(rt.procs), "")


def _running(rt: PodRuntime, container: str) -> subprocess.Popen[bytes]:
    name = _chosen(rt, container)
    proc = rt.procs.get(name)
    if proc is None:
        raise ContainerError(f"container {name!r} of pod {rt.name} is not running")
    return proc


def kill(rt: PodRuntime, container: str) -> list[int]:
    """SIGKILL the process group of the container (every container for ""): the
    pids killed."""
    names = [container] if container else list(rt.procs)
    killed = []
    for name in names:
        proc = rt.procs.get(name)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
    return killed


def kill_worker(rt: PodRuntime, container: str) -> tuple[int, str]:
    """SIGKILL one training process inside the container (the newest python child of
    its main process, e.g. of elasticjob-run), not the container: the launcher must
    notice. Returns its pid and command line."""
    return signal_worker(rt, container, signal.SIGKILL)


def freeze_worker(rt: PodRuntime, container: str) -> tuple[int, str]:
    """SIGSTOP one training process inside the container, as :func:`kill_worker` picks
    it: a hung trainer whose launcher still answers, which only hang detection notices.
    Returns its pid and command line."""
    return signal_worker(rt, container, signal.SIGSTOP)


def signal_worker(rt: PodRuntime, container: str, sig: signal.Signals) -> tuple[int, str]:
    name = _chosen(rt, container)
    proc = rt.procs.get(name)
    child = procs.newest_worker_child(proc.pid) if proc is not None else None
    if child is None:
        raise ContainerError(f"container {name!r} has no python child process")
    with contextlib.suppress(ProcessLookupError):
        os.kill(child[0], sig)
    return child


def freeze(rt: PodRuntime, container: str) -> int:
    """SIGSTOP the container's main process: it hangs (a deadlock, a stuck collective)
    until SIGCONT or SIGKILL. Returns its pid."""
    pid = _running(rt, container).pid
    os.kill(pid, signal.SIGSTOP)
    return pid


def thaw(rt: PodRuntime, container: str) -> int:
    pid = _running(rt, container).pid
    os.kill(pid, signal.SIGCONT)
    return pid


def log_source(rt: PodRuntime, container: str, previous: bool) -> kubelet_server.LogSource | str:
    """The log file `kubectl logs` reads (of the previous start with --previous), or why
    there is none."""
    paths = rt.log_paths.get(container)
    if not paths:
        return f'container "{container}" in pod "{rt.name}" has not started'
    if previous:
        if len(paths) < 2:
            return f'previous terminated container "{container}" in pod "{rt.name}" not found'
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
