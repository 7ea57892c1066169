"""The liveness port and its probe on real loopback sockets; which members a leader
probes, without any."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from elasticjob_runtime.etcd.records import Member
from elasticjob_runtime.rendezvous.liveness import (
    PROBE_AT_MOST,
    PROBE_EVERY_S,
    LivenessPort,
    StragglerProbe,
    open_liveness_port,
    probe_due,
    refused,
)


def test_a_live_port_is_not_refused_and_a_closed_one_is() -> None:
    alive, dead = LivenessPort("127.0.0.1"), LivenessPort("127.0.0.1")
    dead.close()
    try:
        targets = {"alive": ("127.0.0.1", alive.port), "dead": ("127.0.0.1", dead.port)}
        assert refused(targets) == {"dead"}
        # it keeps accepting: a probe every quarter second for a long wait is answered
        for _ in range(3 * 64):  # more than its listen backlog
            assert refused({"alive": ("127.0.0.1", alive.port)}) == set()
    finally:
        alive.close()


def test_a_port_that_does_not_answer_proves_nothing() -> None:
    # A listener whose accept queue is full drops new connections' SYNs unanswered, as a
    # vanished host does: the probe times out, which is not taken for a dead agent.
    with socket.create_server(("127.0.0.1", 0), backlog=0) as full:
        port = full.getsockname()[1]
        queued = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            queued.append(s)
        try:
            assert refused({"silent": ("127.0.0.1", port)}, timeout=0.05) == set()
        finally:
            for s in queued:
                s.close()


def test_a_port_that_cannot_be_bound_leaves_the_node_on_its_lease_alone() -> None:
    assert open_liveness_port("203.0.113.7") is None  # not an address of this host
    port = open_liveness_port("127.0.0.1")
    assert port is not None
    port.close()


def test_closing_the_port_frees_it_and_its_thread() -> None:
    port = LivenessPort("127.0.0.1")
    port.close()
    assert not port._thread.is_alive()
    with socket.create_server(("127.0.0.1", port.port)):  # the port is free again
        pass


def test_a_leader_probes_each_awaited_straggler_once_per_interval() -> None:
    assert probe_due({"b", "a"}, {}, now=10.0) == ["a", "b"]
    probed = {"a": 10.0, "b": 10.0 - 2 * PROBE_EVERY_S}
    assert probe_due({"a", "b"}, probed, now=10.0) == ["b"]
    assert probe_due({"a"}, {"a": float("inf")}, now=10.0) == []  # no port: never
    assert probe_due(set(), {}, now=10.0) == []


def test_a_leader_probes_nobody_while_many_are_still_on_their_way() -> None:
    many = {f"n{i}" for i in range(PROBE_AT_MOST + 1)}
    assert probe_due(many, {}, now=0.0) == []
    assert len(probe_due(set(sorted(many)[:PROBE_AT_MOST]), {}, now=0.0)) == PROBE_AT_MOST


def records(ports: dict[str, int | None]) -> Callable[[list[str]], dict[str, tuple[Member, int]]]:
    """What the member keys hold: each node's record on lease 100 + its index; the nodes
    each read asked for are kept in ``asked``."""
    leases = {node: 100 + i for i, node in enumerate(sorted(ports))}

    def read(nodes: list[str]) -> dict[str, tuple[Member, int]]:
        read.asked.append(list(nodes))  # type: ignore[attr-defined]
        return {n: (Member("127.0.0.1", 1, ports[n]), leases[n]) for n in nodes if n in ports}

    read.asked = []  # type: ignore[attr-defined]
    return read


def test_a_leader_revokes_only_the_lease_of_an_agent_that_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    alive, dead = LivenessPort("127.0.0.1"), LivenessPort("127.0.0.1")
    dead.close()
    try:
        read = records({"alive": alive.port, "dead": dead.port, "old": None})
        probe = StragglerProbe()
        awaited = {"alive", "dead", "old"}
        assert probe.dead(awaited, awaited, read) == {"dead": 101}
        assert probe.probing  # "alive" is probed again in a while, "old" (no port) never
        assert probe.dead({"alive", "old"}, {"alive", "old"}, read) == {}  # not due yet
        assert read.asked == [["alive", "dead", "old"]]  # type: ignore[attr-defined]

        # "dead" is live again under its name: its refusal was not its death
        caplog.set_level("WARNING")
        for _ in range(2):
            assert probe.dead({"dead"}, {"dead"}, read) == {}
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "dead was dropped" in said[0], said
        assert "network policy" in said[0]
    finally:
        alive.close()
