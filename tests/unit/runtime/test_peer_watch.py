"""Each node watches the next one in its round over that node's liveness port: the rules
(whom, and when silence is proof) pure, and the watch itself against real loopback ports
held by real processes that are frozen and killed. Time bounds only catch hangs; how fast
a frozen node is dropped is the benchmark's node-freeze scenario."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from elasticjob_runtime.etcd.client import EtcdError
from elasticjob_runtime.etcd.records import Member
from elasticjob_runtime.rendezvous import liveness
from elasticjob_runtime.rendezvous.liveness import ANSWER, LivenessPort
from elasticjob_runtime.rendezvous.peer_watch import (
    LATE_TURN_S,
    PeerWatch,
    Silence,
    Verdict,
    silence,
    successor,
    watch_ttl,
)

LEASE = 41


def test_each_node_watches_the_next_and_the_last_the_first() -> None:
    ring = ("a", "b", "c")
    assert [successor(ring, n) for n in ring] == ["b", "c", "a"]
    assert successor(("a", "b"), "b") == "a"
    assert successor(("a",), "a") is None  # alone: nobody to watch
    assert successor(ring, "z") is None  # not in the round
    assert successor((), "a") is None


def test_silence_is_proof_only_after_an_answer_and_a_whole_ttl() -> None:
    def judge(answered: float | None, previous: float, now: float) -> tuple[Verdict, float | None]:
        return silence(Silence(answered, previous, now, ttl=1.0))

    assert judge(None, 9.9, 10.0) == (Verdict.WAIT, None)  # never answered: its lease decides
    assert judge(9.0, 9.5, 9.6) == (Verdict.WAIT, 9.0)
    # nearly a TTL: asked on a second connection too, in case the first lost its way
    assert judge(9.0, 9.9, 9.95) == (Verdict.DOUBT, 9.0)
    assert judge(9.0, 9.9, 10.0) == (Verdict.SILENT, 9.0)
    # the watcher's own turn came late (it was starved or frozen): the peer's clock
    # starts again, whatever the gap
    assert judge(9.0, 10.0 - LATE_TURN_S, 10.0) == (Verdict.WAIT, 10.0)
    assert judge(5.0, 9.95, 10.0) == (Verdict.SILENT, 5.0)


def test_a_peer_is_given_its_own_ttl_and_never_less_than_the_watchers() -> None:
    assert watch_ttl(1, Member("10.0.0.2", 7, 9000, ttl=3)) == 3.0
    assert watch_ttl(2, Member("10.0.0.2", 7, 9000, ttl=1)) == 2.0
    assert watch_ttl(1, Member("10.0.0.2", 7, 9000)) == 1.0  # an older agent: none published


def test_the_liveness_port_answers_each_byte_and_hangs_up_when_closed() -> None:
    port = LivenessPort("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", port.port), timeout=5) as conn:
            conn.sendall(b"???")
            got = b""
            while len(got) < 3:
                more = conn.recv(16)
                assert more, f"the port hung up after {got!r}"
                got += more
            assert got == ANSWER * 3
            port.close()
            assert conn.recv(16) == b""  # closed by the port: a watcher sees it at once
    finally:
        port.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port.port), timeout=5).close()


HOLD_PORT = """
import sys, time
from elasticjob_runtime.rendezvous.liveness import LivenessPort
port = LivenessPort("127.0.0.1")
print(port.port, flush=True)
time.sleep(float(sys.argv[1]))
"""


class Peer:
    """A process holding a liveness port, like an agent; stopped by its recorded pid."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_PORT, str(seconds)],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.member = Member(addr="127.0.0.1", pid=self.proc.pid, port=self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class Watching:
    """A watch of the peer "b" by "a" with the given TTL; what it revoked, and when."""

    def __init__(self, published: dict[str, tuple[Member, int]], ttl: int) -> None:
        self.published = published
        self.revoked: list[tuple[int, float]] = []
        self.done = threading.Event()
        self.watch = PeerWatch("a", self.member, self.revoke, lambda: ttl)

    def member(self, node: str) -> tuple[Member, int] | None:
        return self.published.get(node)

    def revoke(self, lease: int) -> None:
        self.revoked.append((lease, time.monotonic()))
        self.done.set()


@pytest.fixture
def peer() -> Iterator[Peer]:
    started = Peer()
    yield started
    started.stop()


@pytest.fixture
def watch() -> Iterator[Callable[[Member, int], Watching]]:
    """Start "a" watching "b", published as ``member`` under ``LEASE``; stopped after."""
    started: list[Watching] = []

    def start(member: Member, ttl: int) -> Watching:
        w = Watching({"b": (member, LEASE)}, ttl)
        w.watch.follow(("a", "b"))
        started.append(w)
        return w

    yield start
    for w in started:
        w.watch.stop()


def answering_for(w: Watching, seconds: float) -> None:
    """Let the watch run; it must revoke nothing meanwhile."""
    assert not w.done.wait(seconds), w.revoked


Watch = Callable[[Member, int], Watching]


def test_a_frozen_peer_is_revoked_after_a_ttl_of_silence_and_not_before(
    peer: Peer, watch: Watch
) -> None:
    w = watch(peer.member, 1)
    answering_for(w, 1.5)  # it answers: nothing happens, past a whole TTL
    os.kill(peer.proc.pid, signal.SIGSTOP)  # its kernel still holds the connection open
    frozen_at = time.monotonic()
    assert w.done.wait(10), "a frozen peer was never revoked"
    (lease, at), *_ = w.revoked
    assert lease == LEASE
    assert at - frozen_at >= 0.8, "revoked before a TTL of silence could have passed"


def test_a_peer_whose_process_died_is_revoked_without_waiting_for_its_ttl(
    peer: Peer, watch: Watch
) -> None:
    w = watch(peer.member, 30)
    answering_for(w, 0.5)
    peer.stop()  # its kernel closes the connection and refuses new ones
    assert w.done.wait(10), "a dead peer was left to its 30 s lease"


def test_a_peer_that_never_answered_is_left_to_its_lease(watch: Watch) -> None:
    """A port whose kernel accepts but nothing answers from the start (frozen before
    this round, or something else listening): silence proves nothing without an answer
    first."""
    mute = socket.create_server(("127.0.0.1", 0))
    try:
        w = watch(Member(addr="127.0.0.1", pid=1, port=mute.getsockname()[1]), 1)
        answering_for(w, 2.0)
    finally:
        mute.close()


def test_nothing_is_revoked_once_another_agent_holds_the_name_or_the_round_moved_on(
    peer: Peer, watch: Watch
) -> None:
    w = watch(peer.member, 1)
    answering_for(w, 0.5)
    w.published["b"] = (Member("127.0.0.1", pid=peer.proc.pid + 1, port=peer.port), LEASE)
    peer.stop()  # the one watched dies, but its name is another agent's now
    answering_for(w, 1.0)
    w.watch.follow(("a",))  # a round of one: nobody to watch
    answering_for(w, 0.5)


def test_an_etcd_that_does_not_answer_leaves_the_peer_to_its_lease(
    peer: Peer, watch: Watch
) -> None:
    w = watch(peer.member, 30)
    answering_for(w, 0.5)

    def unreachable(node: str) -> tuple[Member, int] | None:
        raise EtcdError("etcd at 127.0.0.1:2379 did not answer")

    w.watch._member = unreachable
    peer.stop()
    answering_for(w, 0.5)  # not revoked, and the watch goes on


def test_a_peer_that_announced_itself_again_is_left_to_its_new_lease(
    peer: Peer, watch: Watch
) -> None:
    w = watch(peer.member, 30)
    answering_for(w, 0.5)
    w.published["b"] = (peer.member, LEASE + 1)  # it lived to take a new lease
    peer.stop()
    answering_for(w, 1.0)


def test_nothing_is_revoked_after_the_watch_stopped(peer: Peer, watch: Watch) -> None:
    w = watch(peer.member, 30)
    answering_for(w, 0.5)
    w.watch.stop()  # the node leaves
    peer.stop()
    answering_for(w, 1.0)


class Answerer:
    """A port that answers every connection but goes mute on the first one after a
    while, as a connection stuck in TCP's retransmission back-off looks to its watcher
    while the peer itself is fine. ``mute_all``: every connection goes mute (frozen)."""

    def __init__(self, mute_after: float, mute_all: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.mute_after = mute_after
        self.mute_all = mute_all
        self.started = time.monotonic()
        self.first = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            first, self.first = self.first, False
            threading.Thread(target=self._serve, args=(conn, first), daemon=True).start()

    def _serve(self, conn: socket.socket, first: bool) -> None:
        with conn:
            while True:
                try:
                    got = conn.recv(64)
                except OSError:
                    return
                if not got:
                    return
                mute = (
                    first or self.mute_all
                ) and time.monotonic() - self.started > self.mute_after
                if not mute:
                    conn.sendall(ANSWER * len(got))

    def close(self) -> None:
        self.server.close()


def test_a_silence_a_new_connection_answers_is_not_the_peers(watch: Watch) -> None:
    server = Answerer(mute_after=0.5)
    try:
        w = watch(Member(addr="127.0.0.1", pid=1, port=server.port), 1)
        answering_for(w, 3.0)  # silent on the old connection for 2.5 s: not revoked
        w.watch.stop()
    finally:
        server.close()
    # and the same port silent on every connection is revoked (the test's own control)
    server = Answerer(mute_after=0.5, mute_all=True)
    try:
        w = watch(Member(addr="127.0.0.1", pid=1, port=server.port), 1)
        assert w.done.wait(10), "a port silent on every connection was never revoked"
    finally:
        server.close()


def test_a_port_that_hangs_up_before_it_ever_answered_proves_nothing(watch: Watch) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def hang_up() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except TimeoutError:
                continue

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        w = watch(Member(addr="127.0.0.1", pid=1, port=server.getsockname()[1]), 1)
        answering_for(w, 2.0)
    finally:
        stop.set()
        server.close()


def test_the_port_closes_a_connection_that_asks_nothing_for_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A watcher whose host vanished never hangs up: its place is freed after a while."""
    monkeypatch.setattr(liveness, "IDLE_CLOSE_S", 0.5)
    port = LivenessPort("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", port.port), timeout=10) as conn:
            started = time.monotonic()
            assert conn.recv(16) == b""
            assert time.monotonic() - started < 5
    finally:
        port.close()


def test_an_answer_proves_the_peer_lived_after_the_question_it_answers_was_sent() -> None:
    """Answers come in order, so the n-th answer proves the peer lived after the n-th
    question was sent: the silence is counted from then, as a lease counts from its
    last refresh, not from when the watcher happened to read."""
    from elasticjob_runtime.rendezvous.peer_watch import _Link

    port = LivenessPort("127.0.0.1")
    try:
        link = _Link(Member("127.0.0.1", 1, port.port))
        try:
            before = time.monotonic()
            assert link.ask() is None  # nothing asked yet, nothing answered
            time.sleep(0.2)
            second = time.monotonic()
            alive_at = link.ask()
            assert alive_at is not None and before <= alive_at < second
        finally:
            link.close()
    finally:
        port.close()
