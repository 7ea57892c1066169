"""Fault injection for tests: ask a node agent to break something, the way real clusters break.

Every agent listens on `<cluster dir>/nodes/<node>/control.sock` (control.py defines
the operations and the request/reply). Pod faults find the agent running the pod.

    kill_container(dir, "default", "worker-0")      # SIGKILL; restartPolicy decides
    kill_worker_process(dir, "default", "worker-0")  # SIGKILL one training process in it
    freeze_container(dir, "default", "worker-0")     # SIGSTOP its main process (a hang)
    freeze_worker_process(dir, "default", "worker-0")  # SIGSTOP one training process in it
    thaw_container(dir, "default", "worker-0")       # SIGCONT
    cut_network(dir, "default", "worker-0")          # veth down both ends (and API access)
    restore_network(dir, "default", "worker-0")
    set_node_ready(dir, "node-2", False)             # stop heartbeats; processes keep running
    lose_node(dir, "node-2")                         # kill its pods, stop heartbeats for good
"""

from __future__ import annotations

from pathlib import Path

from elasticjob_devcluster.control import SOCKET_NAME, Op, Reply, Request, call


class FaultError(RuntimeError):
    pass


def _sockets(state_dir: Path) -> list[Path]:
    socks = sorted(Path(state_dir).glob(f"nodes/*/{SOCKET_NAME}"))
    if not socks:
        raise FaultError(f"no node agent control socket under {state_dir}/nodes/*/{SOCKET_NAME}")
    return socks


def node_call(state_dir: Path, node: str, request: Request) -> Reply:
    sock = Path(state_dir) / "nodes" / node / SOCKET_NAME
    if not sock.exists():
        raise FaultError(f"node {node}: no agent control socket at {sock}")
    reply = call(sock, request)
    if not reply.ok:
        raise FaultError(f"node {node}: {reply.error}")
    return reply


def pod_call(state_dir: Path, req: Request) -> Reply:
    """Send a pod fault to whichever agent runs the pod."""
    namespace, pod = req.namespace, req.pod
    for sock in _sockets(state_dir):
        try:
            reply = call(sock, req)
        except OSError:
            continue  # that agent is gone
        if reply.missing:
            continue
        if not reply.ok:
            raise FaultError(f"{namespace}/{pod}: {reply.error}")
        return reply
    raise FaultError(f"pod {namespace}/{pod} is not running on any node agent")


def kill_container(
    state_dir: Path, namespace: str, pod: str, container: str | None = None
) -> list[int]:
    """SIGKILL a container's process group (all containers if None); the pod stays.
    Returns the pids killed."""
    return pod_call(state_dir, Request(Op.KILL, namespace, pod, container or "")).pids


def kill_worker_process(
    state_dir: Path, namespace: str, pod: str, container: str | None = None
) -> int:
    """SIGKILL one training process inside a container: the newest python child of the
    container's main process (for `elasticjob-run`/torchrun, a worker), not the container.
    The launcher is left to notice. Returns the pid killed."""
    return pod_call(state_dir, Request(Op.KILL_WORKER, namespace, pod, container or "")).pids[0]


def freeze_worker_process(
    state_dir: Path, namespace: str, pod: str, container: str | None = None
) -> int:
    """SIGSTOP one training process inside a container, picked as kill_worker_process picks
    it: the trainer hangs while its launcher goes on answering probes, so only the
    launcher's hang detection (spec.hangTimeoutSeconds) can notice. Returns the pid."""
    return pod_call(state_dir, Request(Op.FREEZE_WORKER, namespace, pod, container or "")).pids[0]


def freeze_container(
    state_dir: Path, namespace: str, pod: str, container: str | None = None
) -> int:
    """SIGSTOP a container's main process (the first container if None): it hangs,
    neither exiting nor answering, until thawed, killed or its liveness probe fails.
    Its children keep running. Returns the pid stopped."""
    return pod_call(state_dir, Request(Op.FREEZE, namespace, pod, container or "")).pids[0]


def thaw_container(state_dir: Path, namespace: str, pod: str, container: str | None = None) -> int:
    """SIGCONT what freeze_container stopped. Returns the pid continued."""
    return pod_call(state_dir, Request(Op.THAW, namespace, pod, container or "")).pids[0]


def cut_network(state_dir: Path, namespace: str, pod: str) -> None:
    """Take the pod's link down at both ends; its API-server forwarding stops too."""
    pod_call(state_dir, Request(Op.NETWORK, namespace, pod, up=False))


def restore_network(state_dir: Path, namespace: str, pod: str) -> None:
    pod_call(state_dir, Request(Op.NETWORK, namespace, pod, up=True))


def set_node_ready(state_dir: Path, node: str, ready: bool, report: bool = True) -> None:
    """ready=False: the agent stops all API writes (lease, node and pod status, binding)
    while its pods keep running, like a kubelet cut off from the API server. With
    report=True it first posts Ready=Unknown so the node lifecycle controller reacts at
    once instead of after its grace period. ready=True resumes."""
    node_call(state_dir, node, Request(Op.NODE_READY, ready=ready, report=report))


def lose_node(state_dir: Path, node: str) -> None:
    """The machine dies: every pod process on the node is SIGKILLed and the agent never
    writes to the API server again; the Node goes NotReady through the controller-manager."""
    node_call(state_dir, node, Request(Op.LOSE_NODE))


def ping(state_dir: Path, node: str) -> Reply:
    """The agent answers with its node's name and the pods it runs."""
    return node_call(state_dir, node, Request(Op.PING))
