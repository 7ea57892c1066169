"""A loopback TCP proxy in front of a real server, with the faults a pod's network has.

A node reaches etcd through it and the test turns faults on and off: connections opened
from now on held before they reach the server (:attr:`TcpFaultProxy.hold_new`, as when
a node's new connections time out while its old ones work), and every open connection,
or one of them, stalled for a while (:meth:`TcpFaultProxy.stall`: a network blip, a
starved node, a connection the network dropped without a reset). The
bytes are real etcd traffic; nothing is answered on the server's behalf.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from types import TracebackType

_POLL_S = 0.05


class TcpFaultProxy:
    """Listens on 127.0.0.1 (:attr:`port`) and forwards each connection to ``upstream``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        # seconds a connection accepted from now on waits before it is forwarded
        self.hold_new = 0.0
        self._flowing = threading.Event()  # clear: the connections in _stalled stall
        self._flowing.set()
        self._stalled: frozenset[int] | None = None  # None: all of them
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.accepted = 0
        threading.Thread(target=self._accept, name="tcp-fault-proxy", daemon=True).start()

    def stall(self, seconds: float, connections: frozenset[int] | None = None) -> None:
        """No byte crosses any connection, old or new, for ``seconds`` (returns after);
        ``connections``: only those, by the order they were accepted in (0 first)."""
        self._stalled = connections
        self._flowing.clear()
        try:
            time.sleep(seconds)
        finally:
            self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> TcpFaultProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            index, self.accepted = self.accepted, self.accepted + 1
            with self._lock:
                self._sockets.append(client)
            threading.Thread(
                target=self._serve, args=(client, index, self.hold_new), daemon=True
            ).start()

    def _serve(self, client: socket.socket, index: int, hold: float) -> None:
        if self._closed.wait(hold):
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets.append(upstream)
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink, index), daemon=True).start()

    def _held(self, index: int) -> bool:
        stalled = self._stalled
        return not self._flowing.is_set() and (stalled is None or index in stalled)

    def _pump(self, source: socket.socket, sink: socket.socket, index: int) -> None:
        """Copy ``source`` to ``sink`` until either closes, holding still while stalled
        (what is sent meanwhile waits in the kernel's buffers, as on a congested path)."""
        try:
            while not self._closed.is_set():
                if self._held(index):
                    time.sleep(_POLL_S)
                    continue
                ready, _, _ = select.select([source], [], [], _POLL_S)
                if not ready or self._held(index):
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
