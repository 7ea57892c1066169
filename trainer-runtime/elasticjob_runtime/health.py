"""Liveness/readiness endpoints for pod probes.

``GET /healthz``  200 while the process is alive (and the optional ``live`` check passes)
``GET /readyz``   200 once training has started (``mark_ready`` or the ``ready`` check), else 503

``http.server`` in a daemon thread is enough for probes; nothing here needs a framework.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from elasticjob_runtime import contract


def health_address_from_env() -> tuple[str, int]:
    """Where to listen in a pod: the pod IP (probes come from the kubelet) and the port.

    Without ``ELASTICJOB_POD_IP`` it is 127.0.0.1, never all interfaces.
    """
    host = os.environ.get(contract.POD_IP) or "127.0.0.1"
    raw = os.environ.get(contract.HEALTH_PORT, str(contract.DEFAULT_HEALTH_PORT))
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{contract.HEALTH_PORT}={raw!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{contract.HEALTH_PORT}={port} is outside 0..65535")
    return host, port


def serve_from_env(
    *,
    live: Callable[[], bool] | None = None,
    ready: Callable[[], bool] | None = None,
) -> HealthServer:
    """Start the server where :func:`health_address_from_env` says (for the agent or rank 0)."""
    host, port = health_address_from_env()
    return HealthServer(host, port, live=live, ready=ready).start()


class HealthServer:
    """A tiny HTTP server in a daemon thread; ``port=0`` picks a free port."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = contract.DEFAULT_HEALTH_PORT,
        *,
        live: Callable[[], bool] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._live = live
        self._ready_check = ready
        self._ready = threading.Event()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
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

    def mark_ready(self) -> None:
        """Training has started: ``/readyz`` answers 200 from now on."""
        self._ready.set()

    def is_live(self) -> bool:
        return self._live() if self._live is not None else True

    def is_ready(self) -> bool:
        if self._ready.is_set():
            return True
        return self._ready_check() if self._ready_check is not None else False

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(owner: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "elasticjob-health"

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds would flood the worker's log

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                ok = owner.is_live()
                self._reply(200 if ok else 503, b"ok\n" if ok else b"not live\n")
            elif path == "/readyz":
                ok = owner.is_ready()
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._reply(404, b"not found\n")

    return Handler
