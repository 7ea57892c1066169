"""Each node watches the next one in its round: a frozen or vanished peer is dropped
when it has been silent for a lease TTL, not when etcd's lessor next looks.

A node that freezes (SIGSTOP, a paused VM, a hung kernel) or vanishes (power, a cut
network) closes no connection: its peers learn of it from its member lease, which etcd
deletes 0-0.5 s after the TTL ran out (its lessor looks every 500 ms), 0.8-1.5 s after
the freeze with a 1 s TTL. torchft's lighthouse, with a 1 s heartbeat checked every
100 ms, takes 1.0-1.1 s.

So while a round runs, each node asks the next participant in the round's order (the
last asks the first) for an answer on its liveness port every :data:`ASK_EVERY_S`; the
agent's own thread answers (liveness.py), which a frozen process cannot. A peer silent
for its lease's TTL (published in its member key; the very promise its lease makes) has
its member lease revoked by the watcher, and every node's round watch sees the member
key go at once. A peer whose port closes after it answered is dead at once.

Nothing is dropped on a guess:

* only a peer that answered in this round is judged: one never reached (a network that
  rejects connections between pods, a port not published) is left to its lease;
* a watcher that itself fell behind (starved of CPU, frozen and resumed) gives its peer
  a whole TTL again rather than blame it for the watcher's own silence;
* a peer silent nearly a TTL is asked on a second connection as well, and answers there
  clear it: a connection whose packets were lost for a moment can sit in TCP's
  retransmission back-off for longer than a TTL while the peer is fine;
* before revoking, the watcher reads the peer's member key: gone already, or under a
  different agent (a restart took the name), there is nothing to revoke.

Each node watches one peer and reads one key when it (re)connects, at most once a
second: the cost per node does not grow with the job. Two neighbours frozen at once
leave the second to its lease. The rules are pure (:func:`successor`, :func:`silence`);
:class:`PeerWatch` is the thread and its sockets.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

from elasticjob_runtime.etcd.client import EtcdError
from elasticjob_runtime.etcd.records import Member
from elasticjob_runtime.rendezvous.liveness import ANSWER

log = logging.getLogger(__name__)

# How often a node asks the peer it watches for an answer.
ASK_EVERY_S: Final = 0.1
# How long connecting to a peer's port may take.
CONNECT_TIMEOUT_S: Final = 0.2
# A peer silent this close to its TTL is asked on a second connection too: answers there
# mean the first connection lost its way (TCP's retransmission back-off), not the peer.
DOUBT_BEFORE_S: Final = 0.3
# After a peer could not be reached (no key, no port, refused, timed out), try again
# only this much later: each try reads its member key.
RECONNECT_AFTER_S: Final = 1.0
# A turn this late (the watcher starved or frozen) starts the peer's silence again.
LATE_TURN_S: Final = 0.4


def successor(participants: Sequence[str], node: str) -> str | None:
    """The participant ``node`` watches: the next in the round's order, the last watching
    the first; None in a round of one or one it is not in."""
    if node not in participants or len(participants) < 2:
        return None
    return participants[(participants.index(node) + 1) % len(participants)]


class Verdict(Enum):
    """What a watcher makes of its peer's silence at a turn."""

    WAIT = "wait"  # unproven, or not silent for long enough
    DOUBT = "doubt"  # silent nearly a TTL: ask on a second connection as well
    SILENT = "silent"  # answered in this round, then silent for a TTL: frozen or vanished


@dataclass(frozen=True)
class Silence:
    """A watcher's view of its peer at one turn (pure input to :func:`silence`)."""

    # when the latest question the peer answered was sent: it lived after that; None: it
    # has answered none in this round yet
    answered_at: float | None
    previous_turn: float  # when the watcher last looked
    now: float
    ttl: float  # how long the peer's member lease promises it lives without a word


def silence(s: Silence) -> tuple[Verdict, float | None]:
    """The verdict, and the answer time to keep: after a late turn the watcher's own
    gap is not the peer's silence, so the clock starts again from now."""
    if s.answered_at is None:
        return Verdict.WAIT, None
    if s.now - s.previous_turn >= LATE_TURN_S:
        return Verdict.WAIT, s.now
    silent_for = s.now - s.answered_at
    if silent_for >= s.ttl:
        return Verdict.SILENT, s.answered_at
    if silent_for >= s.ttl - DOUBT_BEFORE_S:
        return Verdict.DOUBT, s.answered_at
    return Verdict.WAIT, s.answered_at


def watch_ttl(own: int, peer: Member) -> float:
    """How long a peer may be silent: its own lease's TTL where it published one, and
    never less than the watcher's (an older agent publishes none)."""
    return float(max(own, peer.ttl or 0, 1))


class _Link:
    """A connection to one peer's liveness port, read and written without blocking."""

    def __init__(self, member: Member) -> None:
        assert member.port is not None
        self.sock = socket.create_connection((member.addr, member.port), CONNECT_TIMEOUT_S)
        self.sock.setblocking(False)
        self._asked: deque[float] = deque()  # when each unanswered question was sent

    def ask(self) -> float | None:
        """Read the answers that came, then send one more question. Returns when the
        latest question answered was sent (answers come in order: the peer lived after
        that moment), or None if no answer came. OSError: the connection was refused,
        reset or closed (the peer's port closed: it died)."""
        alive_at: float | None = None
        while True:
            try:
                got = self.sock.recv(256)
            except BlockingIOError:
                break
            if not got:
                raise ConnectionResetError(errno.ECONNRESET, "the peer closed its port")
            for _ in range(min(got.count(ANSWER), len(self._asked))):
                alive_at = self._asked.popleft()
        try:
            self.sock.send(b"?")
            self._asked.append(time.monotonic())
        except BlockingIOError:  # the peer has not read for long: no more questions
            pass
        return alive_at

    def close(self) -> None:
        self.sock.close()


class PeerWatch:
    """The thread that watches this node's successor in its round (see the module)."""

    def __init__(
        self,
        node: str,
        member: Callable[[str], tuple[Member, int] | None],
        revoke: Callable[[int], None],
        ttl: Callable[[], int],
    ) -> None:
        self._node = node
        self._member = member  # what a node's member key holds, with its lease (one key)
        self._revoke = revoke
        self._ttl = ttl  # this node's member lease TTL as granted
        self._lock = threading.Lock()
        self._participants: tuple[str, ...] = ()
        self._changed = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, participants: Sequence[str]) -> None:
        """Watch this node's successor in a round of ``participants`` from now on (none:
        between rounds). The thread starts with the first round."""
        with self._lock:
            self._participants = tuple(participants)
            if self._thread is None and participants and not self._stopped.is_set():
                self._thread = threading.Thread(
                    target=self._run, name=f"elasticjob-peer-watch-{self._node}", daemon=True
                )
                self._thread.start()
        self._changed.set()

    def stop(self) -> None:
        """End the watch (the node leaves); the thread ends at its next turn, unwaited
        for: leaving must not wait on an etcd call of this thread's."""
        self._stopped.set()
        self._changed.set()

    def _done(self) -> bool:
        return self._changed.is_set() or self._stopped.is_set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._changed.clear()
            with self._lock:
                peer = successor(self._participants, self._node)
            if peer is not None and not self._stopped.is_set():
                try:
                    self._watch(peer)
                except Exception:  # never let a bug here take the agent's watching away
                    log.exception("etcd-v3: %s: watching %s failed", self._node, peer)
            if not self._done():
                self._changed.wait(RECONNECT_AFTER_S)

    def _watch(self, peer: str) -> None:
        """Ask ``peer`` until the round changes, the node leaves or the peer is judged."""
        link: _Link | None = None
        second: _Link | None = None  # opened in doubt (Verdict.DOUBT)
        agent: tuple[Member, int] | None = None  # what its key held when connected
        answered_at: float | None = None
        next_try = 0.0
        previous = time.monotonic()
        try:
            while not self._changed.wait(ASK_EVERY_S) and not self._stopped.is_set():
                now = time.monotonic()
                if link is None:
                    if now >= next_try:
                        link, agent = self._connect(peer)
                        next_try = now + RECONNECT_AFTER_S
                    previous = time.monotonic()
                    continue
                assert agent is not None
                try:
                    if (alive_at := link.ask()) is not None:
                        answered_at = alive_at
                    if second is not None and (alive_at := second.ask()) is not None:
                        link, second = second, link  # the first lost its way
                        answered_at = alive_at
                except OSError as exc:
                    if answered_at is not None:  # it answered, then its port closed: died
                        self._drop(peer, agent, f"its liveness port closed ({exc.strerror})")
                        return
                    link.close()
                    link = None
                    continue
                ttl = watch_ttl(self._ttl(), agent[0])
                verdict, answered_at = silence(Silence(answered_at, previous, now, ttl))
                previous = now
                if verdict is Verdict.WAIT and second is not None:
                    second.close()
                    second = None
                elif verdict is Verdict.DOUBT and second is None:
                    try:
                        second = _Link(agent[0])
                        second.ask()
                    except ConnectionRefusedError:
                        self._drop(peer, agent, "its liveness port refused a connection")
                        return
                    except OSError:  # not reached in time (a vanished host): try again
                        second = None
                elif verdict is Verdict.SILENT:
                    assert answered_at is not None
                    self._drop(peer, agent, f"no answer for {now - answered_at:.2f}s")
                    return
        finally:
            for open_link in (link, second):
                if open_link is not None:
                    open_link.close()

    def _connect(self, peer: str) -> tuple[_Link | None, tuple[Member, int] | None]:
        """A connection to ``peer``'s liveness port and what its member key held (the
        agent and its lease), or (None, None) where there is none to make (no key, no
        port, not reachable now)."""
        try:
            published = self._member(peer)
        except EtcdError:
            return None, None
        if published is None or published[0].port is None:
            return None, None
        try:
            return _Link(published[0]), published
        except OSError:  # refused before it ever answered: proves nothing here
            return None, None

    def _drop(self, peer: str, agent: tuple[Member, int], why: str) -> None:
        """Revoke ``peer``'s member lease if its key still holds the agent and lease
        watched (a new lease: it announced itself since, so it lived; its lease decides)."""
        try:
            published = self._member(peer)
            if published != agent or self._stopped.is_set():
                return  # gone already, another agent or lease under that name, or we left
            log.info(
                "etcd-v3: %s: %s is gone (%s); revoking its member lease", self._node, peer, why
            )
            self._revoke(published[1])
        except EtcdError as exc:  # its lease decides, as without the watch
            log.info("etcd-v3: %s: could not revoke %s's lease: %s", self._node, peer, exc)
