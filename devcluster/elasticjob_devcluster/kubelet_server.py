"""The kubelet HTTPS endpoint the API server calls for `kubectl logs`.

Serves `GET /containerLogs/{namespace}/{pod}/{container}` with follow, tailLines,
timestamps, previous, limitBytes, sinceSeconds and sinceTime, over TLS with the node's
serving cert, and only to clients whose certificate the cluster CA signed (the API
server's kubelet-client cert). `/healthz` answers ok. Exec, attach and port-forward are
not served.
"""

from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

from elasticjob_devcluster import logs

# `-f`: how long a piece of a line waits for its end before it is sent as it is
PIECE_WAIT_S = 1.0


@dataclass(frozen=True)
class LogSource:
    """A container's log file and whether the process writing it still runs."""

    path: Path
    running: Callable[[], bool]


# (namespace, pod, container, previous) -> source, or an error message for a 404
LogLookup = Callable[[str, str, str, bool], "LogSource | str"]


class _LogFile:
    """A container's log, each read going on where the last stopped, through one handle
    held from the first open: the pod's directory goes when the pod is torn down, and what
    the container wrote last (a SIGTERM handler's word) still reaches a follower, as it
    does from a kubelet."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: BinaryIO | None = None

    def read(self) -> bytes:
        if self._file is None:
            try:
                self._file = self._path.open("rb")
            except FileNotFoundError:
                return b""  # not written yet
        return self._file.read()

    def __enter__(self) -> _LogFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


def _flag(q: dict[str, list[str]], name: str) -> bool:
    return q.get(name, ["false"])[-1].lower() in ("true", "1")


def _int(q: dict[str, list[str]], name: str) -> int | None:
    v = q.get(name)
    return int(v[-1]) if v and v[-1].lstrip("-").isdigit() else None


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _text(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if parts == ["healthz"]:
            self._text(200, "ok")
            return
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._text(404, f"not served by the devcluster node agent: {url.path}")
            return
        q = urllib.parse.parse_qs(url.query)
        found = self.server.lookup(parts[1], parts[2], parts[3], _flag(q, "previous"))
        if isinstance(found, str):
            self._text(404, found)
            return
        self._stream(found, q)

    def _stream(self, src: LogSource, q: dict[str, list[str]]) -> None:
        with _LogFile(src.path) as log:
            self._send(src, q, log)

    def _send(self, src: LogSource, q: dict[str, list[str]], log: _LogFile) -> None:
        since: float | None = None
        if (s := _int(q, "sinceSeconds")) is not None:
            since = time.time() - s
        elif q.get("sinceTime"):
            since = logs.parse_time(q["sinceTime"][-1])
        limit = _int(q, "limitBytes")
        timestamps = _flag(q, "timestamps")
        follow = _flag(q, "follow")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        raw = log.read()
        cut = raw.rfind(b"\n") + 1
        pending = raw[cut:]
        lines, partial = logs.assemble(logs.parse(raw[:cut]))
        if not follow:  # the log so far, a line still being written included
            lines, partial = lines + logs.unfinished(partial), {}
        tail = _int(q, "tailLines")
        out = logs.format_lines(
            lines, timestamps=timestamps, tail_lines=tail, since=since, limit_bytes=limit
        )
        sent = len(out)
        self.wfile.write(out)
        self.wfile.flush()
        while follow and (limit is None or sent < limit):
            running = src.running()
            data = pending + log.read()
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            # whole lines, each stream rebuilt on its own: a piece waits for its end, for
            # a moment (output that does not end its line, a progress bar, still shows)
            lines, partial = logs.assemble(logs.parse(data[:cut]), partial)
            waited = {k: v for k, v in partial.items() if time.time() - v.time > PIECE_WAIT_S}
            if not cut and not running:
                waited = partial
            lines += logs.unfinished(waited)
            partial = {k: v for k, v in partial.items() if k not in waited}
            if lines:
                chunk = logs.format_lines(lines, timestamps=timestamps, since=since)
                if limit is not None:
                    chunk = chunk[: limit - sent]
                sent += len(chunk)
                self.wfile.write(chunk)
                self.wfile.flush()
            if not cut and not running:
                break
            if not cut:
                time.sleep(0.2)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    lookup: LogLookup


def serve(
    port: int,
    cert: Path,
    key: Path,
    client_ca: Path,
    lookup: LogLookup,
) -> _Server:
    """Start the endpoint on 127.0.0.1:port in a daemon thread; call .shutdown() to stop."""
    server = _Server(("127.0.0.1", port), _Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    ctx.load_verify_locations(str(client_ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.lookup = lookup
    threading.Thread(target=server.serve_forever, name="kubelet-server", daemon=True).start()
    return server
