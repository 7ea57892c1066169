"""One round's process group: its sockets are shut down to abandon a collective (gloo has
no abort)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from bench.ports import free_port
from elasticjob_runtime.launch.channel import Assignment
from elasticjob_runtime.training.round_group import (
    RoundSuperseded,
    never,
    open_sockets,
    opened_between,
    round_group,
    round_store,
    shut_down,
    wait_for_listener,
)
from elasticjob_runtime.training.worker_rounds import collective_failed


def test_shutting_down_recorded_sockets_fails_a_blocked_read_and_spares_listeners() -> None:
    before = open_sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    left, right = socket.socketpair()
    recorded = opened_between(before, open_sockets())
    assert {listener.fileno(), left.fileno(), right.fileno()} <= set(recorded)

    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(left.recv(10)))
    reader.start()
    time.sleep(0.1)
    assert shut_down(recorded) == 2  # the pair; the listener is left alone
    reader.join(timeout=5)
    assert not reader.is_alive() and got == [b""]
    listener.settimeout(0.01)
    with pytest.raises(TimeoutError):
        listener.accept()  # still listening
    for s in (listener, left, right):
        s.close()


def test_a_recorded_descriptor_reused_by_another_socket_is_not_touched() -> None:
    a, b = socket.socketpair()
    recorded = {a.fileno(): 1}  # not a's inode: the number now names something else
    assert shut_down(recorded) == 0
    a.sendall(b"x")
    assert b.recv(1) == b"x"
    a.close()
    b.close()


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'mpi' is not supported here; use 'gloo' or 'nccl'"):
        round_group("mpi")


def _assignment(rank: int, port: int) -> Assignment:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return Assignment(2, env)


def test_a_build_whose_rank_0_never_serves_gives_up_once_a_newer_round_is_there() -> None:
    """The regroup that hung CI: its round's rank 0 died before serving the store, and
    TCPStore's client would retry for the whole group timeout (30 min)."""
    replaced_at = time.monotonic() + 1.0
    started = time.monotonic()
    with pytest.raises(RoundSuperseded, match="out of reach, and a newer round has replaced it"):
        round_store(
            _assignment(1, free_port()),
            timedelta(minutes=30),
            superseded=lambda: time.monotonic() >= replaced_at,
            window=0.5,
        )
    assert time.monotonic() - started < 20  # generous: a few windows, not the timeout


def test_a_member_waits_for_rank_0_to_listen_and_says_when_nothing_does() -> None:
    port = free_port()
    assert not wait_for_listener("127.0.0.1", port, 0.2)
    served: list[socket.socket] = []
    server = threading.Timer(0.3, lambda: served.append(socket.create_server(("127.0.0.1", port))))
    server.start()
    assert wait_for_listener("127.0.0.1", port, 30)
    assert served, "it said yes before anything listened"
    served[0].close()


def test_a_store_connected_after_some_windows_keeps_the_group_timeout() -> None:
    port = free_port()
    connected: list[object] = []
    client = threading.Thread(
        target=lambda: connected.append(
            round_store(_assignment(1, port), timedelta(minutes=7), never, window=0.3)
        )
    )
    client.start()
    time.sleep(1.0)  # a rank 0 still starting: the client's first windows fail
    server = round_store(_assignment(0, port), timedelta(minutes=7), never)
    client.join(timeout=30)
    assert connected, "the client never connected"
    store = connected[0]
    assert isinstance(store, PrefixStore)
    assert store.underlying_store.timeout == timedelta(minutes=7)
    store.set("k", "v")
    assert server.get("k") == b"v"


def _abort_a_build_whose_peer_never_comes() -> list[BaseException]:
    """What the build raised, aborted a second after it began (as rank 0 of two)."""
    group = round_group("gloo")
    failed: list[BaseException] = []

    def build() -> None:
        try:
            group.build(_assignment(0, free_port()), timedelta(minutes=30))
        except BaseException as exc:  # the test looks at it
            failed.append(exc)

    builder = threading.Thread(target=build)
    builder.start()
    time.sleep(1.0)
    group.abort()
    builder.join(timeout=30)
    assert not builder.is_alive(), "the build went on waiting after the abort"
    group.destroy()
    return failed


def test_an_abort_while_rank_0_waits_for_a_peer_that_never_comes_fails_the_build() -> None:
    """Past the store, the waits of a build are the watcher's to abort (worker_rounds)."""
    failed = _abort_a_build_whose_peer_never_comes()
    assert failed and collective_failed(failed[0]), failed


def test_an_abort_also_shuts_what_the_round_opened_later_for_a_mesh() -> None:
    # An HSDP mesh's replicate group is made after the round's default group; blocked on
    # a dead peer, its collective would wait for the group's timeout unless the abort
    # reaches it too (GlooRoundGroup.adopt).
    group = round_group("gloo")
    with group.adopt():
        left, right = socket.socketpair()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(left.recv(10)))
    reader.start()
    time.sleep(0.1)
    group.abort()
    reader.join(timeout=5)
    assert not reader.is_alive() and got == [b""]
    left.close()
    right.close()


# A peer of one round, in a process of its own (a process has one default group).
_PEER = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from elasticjob_runtime.launch.channel import Assignment
from elasticjob_runtime.training.round_group import round_group
env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": sys.argv[1]}
group = round_group("gloo")
group.build(Assignment(2, env), timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
group.destroy()
sys.exit(0 if total.item() == 2 else 3)
"""


def test_a_member_whose_last_build_failed_joins_its_peers_next_round() -> None:
    """The in-place hang of the full suite (issue 36): torch names a default group from
    a counter that a failed build advanced and only a destroyed group resets, so the
    member put its keys under another prefix than its peers, and all waited."""
    assert _abort_a_build_whose_peer_never_comes(), "the build did not fail"
    assert not dist.is_initialized()

    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port)])
    try:
        group = round_group("gloo")
        group.build(_assignment(0, port), timedelta(seconds=30))  # the hang: 30 s, then fails
        total = torch.ones(1)
        dist.all_reduce(total)
        group.destroy()
        assert total.item() == 2
        assert peer.wait(timeout=60) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


# A member of a first round that waits `delay` seconds before it builds, in a process of
# its own (glibc's settings are process-wide).
_FIRST_MEMBER = """
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from elasticjob_runtime.launch.channel import Assignment
from elasticjob_runtime.training.round_group import round_group
rank, port, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": port, "ELASTICJOB_ROUND_ID": "job/7"}
time.sleep(delay)
group = round_group("gloo")
group.build(Assignment(1, env), timedelta(seconds=60), grow_heap_by=1 << 30)
total = torch.ones(1)
dist.all_reduce(total)
group.destroy()
print(json.dumps({"grown": group.growth.grown, "total": total.item()}))
"""


def test_a_first_member_grows_its_heap_while_it_waits_and_the_last_one_grows_none() -> None:
    port = str(free_port())
    members = [
        subprocess.Popen(
            [sys.executable, "-c", _FIRST_MEMBER, str(rank), port, str(delay)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank, delay in ((0, 0.0), (1, 2.0))
    ]
    try:
        early, late = (json.loads(m.communicate(timeout=120)[0]) for m in members)
    finally:
        for member in members:
            if member.poll() is None:
                member.kill()
                member.wait()
    assert [m.returncode for m in members] == [0, 0]
    assert early["total"] == late["total"] == 2  # the group works
    assert early["grown"] >= 16 << 20, early  # it waited about 2 s
    assert late["grown"] == 0, late  # nobody waits for it: it takes nothing from them
