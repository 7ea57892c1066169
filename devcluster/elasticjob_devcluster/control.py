"""The node agent's control socket: how tests ask an agent to inject a fault.

Both ends live here so the operations and the request/reply shape are defined once:
faults.py sends a Request with `call`, the agent's ControlServer receives it. The
protocol is one JSON line each way per connection on `<node state dir>/control.sock`.
The server's threads only parse and queue a request; the agent's reconcile loop,
which owns all pod state, carries it out (`handle_pending`) and the reply goes back.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

SOCKET_NAME = "control.sock"
REPLY_TIMEOUT_S = 60.0


class Op(StrEnum):
    PING = "ping"
    NODE_READY = "node-ready"  # stop (or resume) every API write of the node
    LOSE_NODE = "lose-node"  # kill every pod and never write again
    KILL = "kill"  # SIGKILL containers' process groups
    KILL_WORKER = "kill-worker"  # SIGKILL one training process inside a container
    NETWORK = "network"  # the pod's link down or up
    FREEZE = "freeze"  # SIGSTOP a container's main process
    FREEZE_WORKER = "freeze-worker"  # SIGSTOP one training process inside a container
    THAW = "thaw"  # SIGCONT it


POD_OPS = frozenset({Op.KILL, Op.KILL_WORKER, Op.NETWORK, Op.FREEZE, Op.FREEZE_WORKER, Op.THAW})


class ProtocolError(ValueError):
    """A line that is not a request or reply of this protocol."""


def _object(line: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"{what} is not a JSON line: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {obj!r}")
    return obj


@dataclass(frozen=True)
class Request:
    op: Op
    namespace: str = "default"  # pod ops: the pod to act on
    pod: str = ""
    container: str = ""  # "" for: all containers (kill), the first one (others)
    up: bool = True  # network: link up (restore) or down (cut)
    ready: bool = True  # node-ready
    report: bool = True  # node-ready False: post Ready=Unknown before going quiet

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> Request:
        obj = _object(line, "request")
        try:
            op = Op(str(obj.get("op")))
        except ValueError:
            ops = ", ".join(o.value for o in Op)
            raise ProtocolError(f"unknown op {obj.get('op')!r}; one of: {ops}") from None
        if op in POD_OPS and not obj.get("pod"):
            raise ProtocolError(f"op {op.value!r} needs the pod's name in 'pod'")
        return cls(
            op=op,
            namespace=str(obj.get("namespace") or "default"),
            pod=str(obj.get("pod") or ""),
            container=str(obj.get("container") or ""),
            up=bool(obj.get("up", True)),
            ready=bool(obj.get("ready", True)),
            report=bool(obj.get("report", True)),
        )


@dataclass(frozen=True)
class Reply:
    ok: bool
    node: str = ""
    error: str = ""
    missing: bool = False  # the pod does not run on this node: ask the next agent
    pids: list[int] = field(default_factory=list)  # processes signalled
    cmdline: str = ""  # kill-worker: the command line of the process killed
    pods: list[str] = field(default_factory=list)  # ping: namespace/name of each pod

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> Reply:
        obj = _object(line, "reply")
        if "ok" not in obj:
            raise ProtocolError(f"reply lacks 'ok': {obj!r}")
        return cls(
            ok=bool(obj["ok"]),
            node=str(obj.get("node") or ""),
            error=str(obj.get("error") or ""),
            missing=bool(obj.get("missing")),
            pids=[int(p) for p in obj.get("pids") or []],
            cmdline=str(obj.get("cmdline") or ""),
            pods=[str(p) for p in obj.get("pods") or []],
        )


def call(sock: Path, request: Request, timeout: float = REPLY_TIMEOUT_S) -> Reply:
    """Send one request to the agent listening on `sock` and wait for its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(request.encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return Reply.decode(data)


Handler = Callable[[Request], Reply]


class ControlServer:
    """The agent's end: accepts connections on its threads, queues each request for the
    reconcile loop (woken through `wake`), and writes back the reply it produces."""

    def __init__(self, path: Path, wake: threading.Event) -> None:
        self.path = path
        self.wake = wake
        self.requests: queue.Queue[tuple[Request, queue.Queue[Reply]]] = queue.Queue()
        self._sock: socket.socket | None = None

    def start(self, stop: threading.Event) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(self.path))
        srv.listen(8)
        self._sock = srv

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

        threading.Thread(target=serve, name="control", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rwb")
            try:
                request = Request.decode(f.readline())
                reply: queue.Queue[Reply] = queue.Queue()
                self.requests.put((request, reply))
                self.wake.set()
                resp = reply.get(timeout=REPLY_TIMEOUT_S)
            except Exception as e:
                resp = Reply(ok=False, error=str(e))
            f.write(resp.encode())
            f.flush()

    def handle_pending(self, handler: Handler) -> None:
        """Carry out every queued request (called by the loop that owns the pods)."""
        while True:
            try:
                request, reply = self.requests.get_nowait()
            except queue.Empty:
                return
            try:
                reply.put(handler(request))
            except Exception as e:
                reply.put(Reply(ok=False, error=f"{type(e).__name__}: {e}"))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
