"""A node's liveness port, and the probe that tells a dead agent from a slow one at once.

A member lease says a node is gone only when its TTL has run out and etcd's lessor has
looked (0.8-1.5 s with a 1 s TTL, :mod:`~elasticjob_runtime.rendezvous.leases`). When the
agent's process died but its host (or its pod's network namespace) is still there, the
kernel knows sooner: a TCP connection to a port the agent listened on is refused at once.
So each agent listens on a port of its own (published in its member key), accepting and
closing whatever connects; a round's leader that waits for a live member connects to it,
and a refused connection proves the agent gone, so the leader revokes its member lease
instead of waiting out the TTL. Anything else (accepted, timed out, unreachable) proves
nothing: a frozen process's kernel still accepts, a vanished host does not answer, and
the lease decides as before. Nothing is ever dropped on a guess.

The port also answers: each byte a peer sends is answered with :data:`ANSWER` by this
agent's own thread, which a frozen process's kernel cannot do for it. A peer that watches
this node (:mod:`~elasticjob_runtime.rendezvous.peer_watch`) learns from the silence that
it froze, without waiting for etcd's lessor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import selectors
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Final

from elasticjob_runtime.etcd.records import Member

log = logging.getLogger(__name__)

# How long a probe waits for connections to be refused. A refusal comes back within a
# round trip (on loopback, at once); one that has not by then is not acted on.
PROBE_TIMEOUT_S: Final = 0.05
# How often a leader probes a member it still waits for: a member that was alive when
# first probed and dies while the leader waits is found at the next probe.
PROBE_EVERY_S: Final = 0.1
# A leader probes the members it waits for only while they are this few.
PROBE_AT_MOST: Final = 8


def _family(addr: str) -> socket.AddressFamily:
    """IPv6 for an address with colons, else IPv4 (a name resolves to IPv4)."""
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


# What the port sends back for each byte a watching peer sends (peer_watch.py).
ANSWER: Final = b"!"
# Connections a port holds open at once (watching peers; a probe hangs up at once): one
# more is closed as soon as it is accepted.
OPEN_AT_MOST: Final = 64
# A connection that asked nothing for this long is closed: its watcher's host vanished
# without a word (a watcher asks ten times a second), and it would hold a place for ever.
IDLE_CLOSE_S: Final = 10.0


class LivenessPort:
    """A TCP port this agent listens on while its process lives, on its rendezvous
    address. A daemon thread accepts each connection and answers each byte it receives
    with :data:`ANSWER` until the peer hangs up (a probe sends nothing and hangs up)."""

    def __init__(self, addr: str) -> None:
        self._sock = socket.create_server((addr, 0), family=_family(addr), backlog=64)
        try:
            self._sock.setblocking(False)
            self.port: int = self._sock.getsockname()[1]
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._sock, selectors.EVENT_READ)
            self._wake, self._waker = socket.socketpair()  # close() wakes the thread
            self._selector.register(self._wake, selectors.EVENT_READ)
        except BaseException:
            self._sock.close()
            raise
        self._asked_at: dict[socket.socket, float] = {}  # open connections, last question
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="elasticjob-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select(timeout=IDLE_CLOSE_S / 2):
                    try:
                        if key.fileobj is self._sock:
                            self._accept()
                        elif key.fileobj is not self._wake:
                            self._answer(key.fileobj)  # type: ignore[arg-type]
                    except Exception:  # never stop answering: peers would take it for dead
                        log.exception("liveness port %d: unexpected error", self.port)
                self._close_idle(time.monotonic())
        finally:  # the listening socket too: a probe is refused from here on
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._waker.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.01)  # no file left: the connection waits in the backlog
            return  # else a prober that hung up first: go on
        if len(self._asked_at) >= OPEN_AT_MOST:
            conn.close()
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ)
        self._asked_at[conn] = time.monotonic()

    def _answer(self, conn: socket.socket) -> None:
        try:
            asked = conn.recv(256)
            if asked:
                conn.send(ANSWER * len(asked))
                self._asked_at[conn] = time.monotonic()
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._drop(conn)  # it hung up (or broke)

    def _close_idle(self, now: float) -> None:
        for conn, asked_at in list(self._asked_at.items()):
            if now - asked_at >= IDLE_CLOSE_S:
                self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._asked_at.pop(conn, None)
        self._selector.unregister(conn)
        conn.close()

    def close(self) -> None:
        """Stop listening and answering: a probe is refused from now on, and a watching
        peer's connection closed, as for a dead agent."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._waker.send(b"x")
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():  # stuck: at least stop accepting
            self._sock.close()


def open_liveness_port(addr: str) -> LivenessPort | None:
    """A liveness port on ``addr``, or None (said once) where it cannot be bound: peers
    then learn of this node's death from its lease alone, as before."""
    try:
        return LivenessPort(addr)
    except OSError as exc:
        log.info(
            "etcd-v3: no liveness port on %s (%s): peers notice this node's death from "
            "its member lease alone",
            addr,
            exc,
        )
        return None


def refused(targets: Mapping[str, tuple[str, int]], timeout: float = PROBE_TIMEOUT_S) -> set[str]:
    """The nodes among ``targets`` (node -> (address, liveness port)) whose port refused a
    TCP connection within ``timeout``: their agents are certainly dead. All are probed
    at once, without blocking on any."""
    opened: list[socket.socket] = []
    gone: set[str] = set()
    with selectors.DefaultSelector() as selector:
        for node, (host, port) in targets.items():
            sock = socket.socket(_family(host))
            opened.append(sock)
            sock.setblocking(False)
            try:
                code = sock.connect_ex((host, port))
            except OSError:  # an address that does not resolve: proves nothing
                continue
            if code == errno.ECONNREFUSED:
                gone.add(node)
            elif code in (0, errno.EINPROGRESS):
                selector.register(sock, selectors.EVENT_WRITE, (sock, node))
        deadline = time.monotonic() + timeout
        try:
            while selector.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    sock, node = key.data
                    selector.unregister(sock)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                        gone.add(node)
        finally:
            for sock in opened:
                sock.close()
    return gone


def probe_due(awaited: Collection[str], probed_at: Mapping[str, float], now: float) -> list[str]:
    """Which of the live members a leader still waits for to probe now (pure): each once
    every :data:`PROBE_EVERY_S`, and only stragglers, at most :data:`PROBE_AT_MOST` of
    them. A dead member is one the others no longer wait with; while many are still
    on their way (a job starting, a thousand agents arriving) probing them all proves
    nothing and costs a connection each."""
    if len(awaited) > PROBE_AT_MOST:
        return []
    return sorted(n for n in awaited if now - probed_at.get(n, -math.inf) >= PROBE_EVERY_S)


class StragglerProbe:
    """One leader's probing of the members it waits for: when it probed each, which it
    had dropped, and which it no longer trusts a refusal from."""

    def __init__(self) -> None:
        self._probed_at: dict[str, float] = {}  # inf: published no port, never probed
        self._dropped: set[str] = set()
        self._distrusted: set[str] = set()

    @property
    def probing(self) -> bool:
        """Is a member this leader waits for due to be probed again (in a while)?"""
        return any(t < math.inf for t in self._probed_at.values())

    def dead(
        self,
        awaited: Collection[str],
        live: Collection[str],
        members: Callable[[list[str]], Mapping[str, tuple[Member, int]]],
    ) -> dict[str, int]:
        """The awaited members whose agents refused a probe now, with the member lease of
        each to revoke. ``members`` reads what the given nodes published (their record and
        lease). A node this leader dropped that is live again refused while alive (a
        network that rejects connections between the nodes, say): it is said once, and
        from then on only its lease decides for it."""
        for node in sorted((self._dropped & set(live)) - self._distrusted):
            log.warning(
                "etcd-v3: %s was dropped because its liveness port refused a connection, "
                "yet it is live again: connections to it are rejected while it lives (a "
                "network policy between the job's pods?). Its lease alone decides for it "
                "from now on",
                node,
            )
            self._distrusted.add(node)
        candidates = [n for n in awaited if n not in self._distrusted]
        self._probed_at = {n: t for n, t in self._probed_at.items() if n in candidates}
        now = time.monotonic()
        due = probe_due(candidates, self._probed_at, now)
        if not due:
            return {}
        published = members(due)
        targets = {
            node: (member.addr, member.port)
            for node, (member, _) in published.items()
            if member.port is not None
        }
        for node in due:
            self._probed_at[node] = now if node in targets else math.inf
        gone = refused(targets)
        self._dropped |= gone
        return {node: published[node][1] for node in sorted(gone)}
