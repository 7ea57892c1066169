"""Liveness and readiness probes for the pod of an ``elasticjob-run`` agent.

``GET /healthz``  200 while the agent process answers at all. A frozen agent (SIGSTOP, a
                  hung interpreter) does not, so the kubelet restarts it. Nothing more is
                  checked: an agent legitimately blocks for minutes in a rendezvous.
``GET /readyz``   200 once the agent's workers have run in a round (the pod has joined the
                  job), from then on; 503 before. Not ready again at every rendezvous:
                  see :mod:`elasticjob_runtime.launch.agent` for why.

``elasticjob-run`` serves them in a pod (``ELASTICJOB_POD_NAME`` set) or wherever
``ELASTICJOB_HEALTH_PORT`` is set, on ``ELASTICJOB_POD_IP`` (else 127.0.0.1). ``http.server``
in a daemon thread is enough for probes; nothing here needs a framework.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from elasticjob_runtime import contract


def health_wanted(env: Mapping[str, str]) -> bool:
    """Serve probes in a pod, or where a port is asked for (several agents on one host
    each need their own)."""
    return bool(env.get(contract.POD_NAME)) or contract.HEALTH_PORT in env


def health_address(env: Mapping[str, str]) -> tuple[str, int]:
    """Where to listen: the pod IP (probes come from the kubelet) and the port.

    Without ``ELASTICJOB_POD_IP`` it is 127.0.0.1, never all interfaces.
    """
    host = env.get(contract.POD_IP) or "127.0.0.1"
    raw = env.get(contract.HEALTH_PORT, str(contract.DEFAULT_HEALTH_PORT))
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{contract.HEALTH_PORT}={raw!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{contract.HEALTH_PORT}={port} is outside 0..65535")
    return host, port


def client_hung_up(exc: BaseException | None) -> bool:
    """A request that failed because the client went away. Normal for probes: the
    kubelet (and the devcluster's prober) reads the status line and closes, often before
    the body is sent, so the reply meets a reset or a broken pipe."""
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError))


class _ProbeServer(ThreadingHTTPServer):
    """Says nothing about clients that hang up; anything else is printed as before."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if client_hung_up(sys.exc_info()[1]):
            return
        super().handle_error(request, client_address)


class HealthServer:
    """A tiny HTTP server in a daemon thread; ``port=0`` picks a free port."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = contract.DEFAULT_HEALTH_PORT,
        *,
        ready: Callable[[], bool],
    ) -> None:
        self.ready = ready
        self._server = _ProbeServer((host, port), _handler_for(self))
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HealthServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="elasticjob-health", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(owner: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "elasticjob-health"

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds would flood the agent's log

        def _reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                ok = owner.ready()
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._reply(404, b"not found\n")

    return Handler
