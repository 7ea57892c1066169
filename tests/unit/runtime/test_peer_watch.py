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
from collections.abc import Iterator, Mapping

import pytest

from elasticjob_runtime.etcd.client import EtcdError
from elasticjob_runtime.etcd.records import Member
from elasticjob_runtime.rendezvous.liveness import ANSWER, LivenessPort
from elasticjob_runtime.rendezvous.peer_watch import (
    LATE_TURN_S,
    PeerWatch,
    Silence,
    Verdict,
    silence,
    successor,
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
    assert judge(9.0, 9.9, 9.95) == (Verdict.WAIT, 9.0)
    assert judge(9.0, 9.9, 10.0) == (Verdict.SILENT, 9.0)
    # the watcher's own turn came late (it was starved or frozen): the peer's clock
    # starts again, whatever the gap
    assert judge(9.0, 10.0 - LATE_TURN_S, 10.0) == (Verdict.WAIT, 10.0)
    assert judge(5.0, 9.95, 10.0) == (Verdict.SILENT, 5.0)


def test_the_liveness_port_answers_each_byte_and_hangs_up_when_closed() -> None:
    port = LivenessPort("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", port.port), timeout=5) as conn:
            conn.sendall(b"???")
            got = b""
            while len(got) < 3:
                got += conn.recv(16)
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
        self.watch = PeerWatch("a", self.members, self.revoke, lambda: ttl)

    def members(self, nodes: list[str]) -> Mapping[str, tuple[Member, int]]:
        return {n: self.published[n] for n in nodes if n in self.published}

    def revoke(self, lease: int) -> None:
        self.revoked.append((lease, time.monotonic()))
        self.done.set()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for p in started:
        p.stop()


def answering_for(w: Watching, seconds: float) -> None:
    """Let the watch run; it must revoke nothing meanwhile."""
    assert not w.done.wait(seconds), w.revoked


def test_a_frozen_peer_is_revoked_after_a_ttl_of_silence_and_not_before(
    peers: list[Peer],
) -> None:
    b = Peer()
    peers.append(b)
    w = Watching({"b": (b.member, LEASE)}, ttl=1)
    w.watch.follow(("a", "b"))
    try:
        answering_for(w, 1.5)  # it answers: nothing happens, past a whole TTL
        os.kill(b.proc.pid, signal.SIGSTOP)  # its kernel still holds the connection open
        frozen_at = time.monotonic()
        assert w.done.wait(10), "a frozen peer was never revoked"
        (lease, at), *_ = w.revoked
        assert lease == LEASE
        assert at - frozen_at >= 0.8, "revoked before a TTL of silence could have passed"
    finally:
        w.watch.stop()


def test_a_peer_whose_process_died_is_revoked_without_waiting_for_its_ttl(
    peers: list[Peer],
) -> None:
    b = Peer()
    peers.append(b)
    w = Watching({"b": (b.member, LEASE)}, ttl=30)
    w.watch.follow(("a", "b"))
    try:
        answering_for(w, 0.5)
        b.stop()  # its kernel closes the connection and refuses new ones
        assert w.done.wait(10), "a dead peer was left to its 30 s lease"
    finally:
        w.watch.stop()


def test_a_peer_that_never_answered_is_left_to_its_lease(peers: list[Peer]) -> None:
    """A port whose kernel accepts but nothing answers from the start (frozen before
    this round, or something else listening): silence proves nothing without an answer
    first."""
    mute = socket.create_server(("127.0.0.1", 0))
    try:
        member = Member(addr="127.0.0.1", pid=1, port=mute.getsockname()[1])
        w = Watching({"b": (member, LEASE)}, ttl=1)
        w.watch.follow(("a", "b"))
        try:
            answering_for(w, 2.0)
        finally:
            w.watch.stop()
    finally:
        mute.close()


def test_nothing_is_revoked_once_another_agent_holds_the_name_or_the_round_moved_on(
    peers: list[Peer],
) -> None:
    b = Peer()
    peers.append(b)
    w = Watching({"b": (b.member, LEASE)}, ttl=1)
    w.watch.follow(("a", "b"))
    try:
        answering_for(w, 0.5)
        w.published["b"] = (Member("127.0.0.1", pid=b.proc.pid + 1, port=b.port), LEASE + 1)
        b.stop()  # the one watched dies, but its name is another agent's now
        answering_for(w, 1.0)
        w.watch.follow(("a",))  # a round of one: nobody to watch
        answering_for(w, 0.5)
    finally:
        w.watch.stop()


def test_an_etcd_that_does_not_answer_leaves_the_peer_to_its_lease(peers: list[Peer]) -> None:
    b = Peer()
    peers.append(b)
    w = Watching({"b": (b.member, LEASE)}, ttl=30)
    w.watch.follow(("a", "b"))
    try:
        answering_for(w, 0.5)

        def unreachable(nodes: list[str]) -> Mapping[str, tuple[Member, int]]:
            raise EtcdError("etcd at 127.0.0.1:2379 did not answer")

        w.watch._members = unreachable
        b.stop()
        answering_for(w, 0.5)  # not revoked, and the watch goes on
    finally:
        w.watch.stop()
