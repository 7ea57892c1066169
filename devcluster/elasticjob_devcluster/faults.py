"""Fault injection for tests: ask a node agent to break something, the way real clusters break.

Every agent listens on `<cluster dir>/nodes/<node>/control.sock` (one JSON request and
one JSON reply per connection). Pod faults find the agent running the pod themselves.

    kill_container(dir, "default", "worker-0")      # SIGKILL; restartPolicy decides
    kill_worker_process(dir, "default", "worker-0")  # SIGKILL one training process in it
    cut_network(dir, "default", "worker-0")          # veth down both ends (and API access)
    restore_network(dir, "default", "worker-0")
    set_node_ready(dir, "node-2", False)             # stop heartbeats; processes keep running
    lose_node(dir, "node-2")                         # kill its pods, stop heartbeats for good
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any


class FaultError(RuntimeError):
    pass


def _call(sock: Path, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data)
    return reply


def _sockets(state_dir: Path) -> list[Path]:
    socks = sorted(Path(state_dir).glob("nodes/*/control.sock"))
    if not socks:
        raise FaultError(f"no node agent control socket under {state_dir}/nodes/*/control.sock")
    return socks


def node_call(state_dir: Path, node: str, request: dict[str, Any]) -> dict[str, Any]:
    sock = Path(state_dir) / "nodes" / node / "control.sock"
    if not sock.exists():
        raise FaultError(f"node {node}: no agent control socket at {sock}")
    reply = _call(sock, request)
    if not reply.get("ok"):
        raise FaultError(f"node {node}: {reply.get('error')}")
    return reply


def pod_call(state_dir: Path, namespace: str, pod: str, request: dict[str, Any]) -> dict[str, Any]:
    """Send a pod fault to whichever agent runs the pod."""
    req = dict(request, namespace=namespace, pod=pod)
    for sock in _sockets(state_dir):
        try:
            reply = _call(sock, req)
        except OSError:
            continue  # that agent is gone
        if reply.get("missing"):
            continue
        if not reply.get("ok"):
            raise FaultError(f"{namespace}/{pod}: {reply.get('error')}")
        return reply
    raise FaultError(f"pod {namespace}/{pod} is not running on any node agent")


def kill_container(
    state_dir: Path, namespace: str, pod: str, container: str | None = None
) -> list[int]:
    """SIGKILL a container's process group (all containers if None); the pod stays.
    Returns the pids killed."""
    req: dict[str, Any] = {"op": "kill"}
    if container:
        req["container"] = container
    killed: list[int] = pod_call(state_dir, namespace, pod, req)["killed"]
    return killed


def kill_worker_process(
    state_dir: Path, namespace: str, pod: str, container: str | None = None
) -> int:
    """SIGKILL one training process inside a container: the newest python child of the
    container's main process (for `elasticjob-run`/torchrun, a worker), not the container.
    The launcher is left to notice. Returns the pid killed."""
    req: dict[str, Any] = {"op": "kill-worker"}
    if container:
        req["container"] = container
    killed: int = pod_call(state_dir, namespace, pod, req)["killed"]
    return killed


def cut_network(state_dir: Path, namespace: str, pod: str) -> None:
    """Take the pod's link down at both ends; its API-server forwarding stops too."""
    pod_call(state_dir, namespace, pod, {"op": "network", "up": False})


def restore_network(state_dir: Path, namespace: str, pod: str) -> None:
    pod_call(state_dir, namespace, pod, {"op": "network", "up": True})


def set_node_ready(state_dir: Path, node: str, ready: bool, report: bool = True) -> None:
    """ready=False: the agent stops all API writes (lease, node and pod status, binding)
    while its pods keep running, like a kubelet cut off from the API server. With
    report=True it first posts Ready=Unknown so the node lifecycle controller reacts at
    once instead of after its grace period. ready=True resumes."""
    node_call(state_dir, node, {"op": "node-ready", "ready": ready, "report": report})


def lose_node(state_dir: Path, node: str) -> None:
    """The machine dies: every pod process on the node is SIGKILLed and the agent never
    writes to the API server again; the Node goes NotReady through the controller-manager."""
    node_call(state_dir, node, {"op": "lose-node"})


def ping(state_dir: Path, node: str) -> dict[str, Any]:
    return node_call(state_dir, node, {"op": "ping"})
