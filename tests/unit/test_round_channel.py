"""The agent-worker channel, the round group's socket abort, and the loop API's rules."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.channel import AgentChannel, Assignment, WorkerChannel
from elasticjob_runtime.elastic import collective_failed, steps_left
from elasticjob_runtime.round_group import open_sockets, opened_between, round_group, shut_down

ENV = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}


def test_an_assignment_round_trips_and_names_its_round() -> None:
    a = Assignment(4, dict(ENV), abort=True)
    back = Assignment.from_json(a.to_json())
    assert back == a
    assert (back.rank, back.world_size, back.master) == (1, 3, ("10.0.0.7", 29500))
    other = Assignment(5, {**ENV, "MASTER_PORT": "29501"})
    assert a.store_prefix() != other.store_prefix()
    assert Assignment(9, dict(ENV)).store_prefix() == a.store_prefix()  # same round, any agent


def test_a_worker_sees_each_newer_assignment_and_waits_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = AgentChannel(tmp_path)
    monkeypatch.setenv(contract.AGENT_CHANNEL, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    worker = WorkerChannel.from_env()
    assert worker is not None and worker.latest() is None
    agent.deliver(1, {0: {**ENV, "RANK": "0"}, 1: ENV}, abort=False)
    first = worker.latest()
    assert first is not None and (first.generation, first.rank, first.abort) == (1, 1, False)
    assert worker.wait_newer(1, timeout=0.05) is None

    later = threading.Timer(0.1, lambda: agent.deliver(2, {1: {**ENV, "RANK": "2"}}, abort=True))
    later.start()
    found = worker.wait_newer(1, timeout=10)
    later.join()
    assert found is not None and (found.generation, found.rank, found.abort) == (2, 2, True)


def test_outside_elasticjob_run_there_is_no_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.AGENT_CHANNEL, raising=False)
    assert WorkerChannel.from_env() is None
    monkeypatch.setenv(contract.AGENT_CHANNEL, "/nonexistent/elasticjob")
    assert WorkerChannel.from_env() is None


def test_the_agent_reads_offers_and_regroup_requests_for_the_running_round(
    tmp_path: Path,
) -> None:
    agent = AgentChannel(tmp_path)
    workers = [WorkerChannel(tmp_path, rank) for rank in (0, 1)]
    for w in workers:
        w.offer_in_place()
    assert agent.in_place_pids() == {0: os.getpid(), 1: os.getpid()}
    workers[1].request_regroup(3)
    assert agent.regroup_requested(3)
    assert not agent.regroup_requested(4)  # a request from an older round is stale
    agent.forget_workers()
    assert agent.in_place_pids() == {}


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


def test_steps_left_is_the_same_on_every_rank_and_counts_the_uneven_end() -> None:
    assert steps_left(1024, 4, 8) == 32
    assert steps_left(1000, 4, 8) == 32  # the last global batch holds 8 samples
    assert steps_left(0, 4, 8) == 0


def test_only_a_broken_group_counts_as_a_failed_collective() -> None:
    import torch.distributed as dist

    gloo = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    )
    assert collective_failed(gloo)
    assert collective_failed(dist.DistNetworkError("store gone"))
    assert not collective_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not collective_failed(ValueError("Connection closed by peer"))


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'mpi' is not supported here; use 'gloo' or 'nccl'"):
        round_group("mpi")
