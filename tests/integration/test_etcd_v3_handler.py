"""The etcd-v3 handler in-process against real etcd 3.5 and 3.6: rounds, lost peers, close."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import EtcdServer, start_etcd
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elasticjob_runtime import contract
from elasticjob_runtime.etcd_client import EtcdClient, parse_endpoint
from elasticjob_runtime.membership import Limits, Round
from elasticjob_runtime.rendezvous import EtcdV3RendezvousBackend, EtcdV3RendezvousHandler

pytestmark = pytest.mark.integration


Factory = Callable[..., tuple[EtcdV3RendezvousHandler, EtcdClient]]


@pytest.fixture
def handlers(etcd_any: EtcdServer) -> Iterator[Factory]:
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []
    run_id = f"handler-{uuid.uuid4().hex[:8]}"

    def make(
        lo: int = 1, hi: int = 3, join_timeout: float = 60.0
    ) -> tuple[EtcdV3RendezvousHandler, EtcdClient]:
        client = EtcdClient(parse_endpoint(etcd_any.endpoint), timeout=10)
        handler = EtcdV3RendezvousHandler(
            client, run_id, Limits(lo, hi, last_call=15), "127.0.0.1", join_timeout=join_timeout
        )
        made.append((handler, client))
        return handler, client

    yield make
    for handler, client in made:
        handler._leave()
        client.close()


def join_all(*handlers: EtcdV3RendezvousHandler) -> list[RendezvousInfo]:
    results: dict[int, RendezvousInfo] = {}
    errors: list[BaseException] = []

    def join(i: int, h: EtcdV3RendezvousHandler) -> None:
        try:
            results[i] = h.next_rendezvous()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i, h)) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return [results[i] for i in range(len(handlers))]


def wait_until(check: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s")


def test_nodes_meet_at_once_when_all_live_nodes_have_joined(handlers: Factory) -> None:
    a, _ = handlers()
    b, _ = handlers()
    started = time.monotonic()
    infos = join_all(a, b)
    # min 1, max 3: torch's dynamic handler would sit out a 30 s last call here.
    assert time.monotonic() - started < 10
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    assert (
        len(
            {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in infos
            }
        )
        == 1
    )


def test_a_crashed_peer_is_reported_within_the_lease_ttl_and_the_next_round_excludes_it(
    handlers: Factory,
) -> None:
    a, _ = handlers()
    b, _ = handlers()
    join_all(a, b)
    assert a.num_nodes_waiting() == 0

    b._stop.set()  # b's process "dies": no more keep-alives, nothing revoked
    took = wait_until(lambda: a.num_nodes_waiting() > 0, 15)
    assert took < 6, f"lost peer noticed after {took:.1f}s"

    (info,) = join_all(a)
    assert (info.rank, info.world_size) == (0, 1)


def test_a_node_whose_sealed_round_was_superseded_joins_the_newer_one(handlers: Factory) -> None:
    # b finds itself in a sealed round {a, b}, but a only reads the state after c has
    # opened a newer round. b must not wait for a inside the stale round.
    a, client = handlers()
    b, _ = handlers()
    c, _ = handlers()
    stale = Round(number=1, participants=(a.node, b.node), complete=True)
    assert EtcdV3RendezvousBackend(client, a.get_run_id()).set_state(stale.encode()) is not None
    result: list[RendezvousInfo] = []
    b_joins = threading.Thread(target=lambda: result.append(b.next_rendezvous()))
    b_joins.start()
    time.sleep(0.5)
    infos = join_all(c, a)
    b_joins.join(timeout=60)
    assert result, "b never finished joining"
    assert {info.world_size for info in [*infos, *result]} == {3}
    assert sorted(info.rank for info in [*infos, *result]) == [0, 1, 2]


def test_old_rounds_keys_are_dropped(handlers: Factory) -> None:
    a, client = handlers(lo=1, hi=1)
    for _ in range(4):
        (info,) = join_all(a)
        info.store.set("k", b"v")
    rounds = {
        key.split("/store/")[1].split("/")[0]
        for key in client.snapshot(contract.run_prefix(a.get_run_id())).items
        if "/store/" in key
    }
    assert len(rounds) <= 2, rounds


def test_a_closed_rendezvous_turns_away_newcomers_with_a_clear_error(handlers: Factory) -> None:
    a, _ = handlers()
    join_all(a)
    assert a.shutdown() and a.is_closed()
    late, _ = handlers()
    with pytest.raises(RendezvousClosedError, match="closed"):
        late.next_rendezvous()


def test_a_round_below_min_nodes_times_out_saying_what_is_missing(handlers: Factory) -> None:
    a, _ = handlers(lo=2, hi=2, join_timeout=2)
    with pytest.raises(RendezvousTimeoutError, match="1 of at least 2 nodes have joined"):
        a.next_rendezvous()


def test_torch_registry_builds_the_handler_from_torchrun_parameters(etcd: EtcdServer) -> None:
    params = RendezvousParameters(
        backend="etcd-v3",
        endpoint=etcd.endpoint,
        run_id=f"registry-{uuid.uuid4().hex[:6]}",
        min_nodes=1,
        max_nodes=2,
        local_addr="127.0.0.1",
        lease_ttl="3",
    )
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, EtcdV3RendezvousHandler)
    assert handler.get_backend() == "etcd-v3" and not handler.use_agent_store
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert handler.shutdown()


def test_membership_is_still_watched_after_etcd_restarts(tmp_path: Path) -> None:
    server = start_etcd("3.5", tmp_path / "etcd")
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []
    try:
        for _ in range(2):
            client = EtcdClient(parse_endpoint(server.endpoint), timeout=10)
            handler = EtcdV3RendezvousHandler(client, "restarts", Limits(1, 3, 15), "127.0.0.1")
            made.append((handler, client))
        (a, _), (b, _) = made
        join_all(a, b)

        server.restart()
        time.sleep(1.0)
        assert a.num_nodes_waiting() == 0  # nothing changed; a notices its watch is gone

        b._leave()
        took = wait_until(lambda: a.num_nodes_waiting() > 0, 15)
        assert took < 10
    finally:
        for handler, client in made:
            handler._leave()
            client.close()
        server.stop()


def test_a_join_rides_out_an_etcd_restart(tmp_path: Path) -> None:
    server = start_etcd("3.5", tmp_path / "etcd")
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []
    try:
        for _ in range(2):
            client = EtcdClient(parse_endpoint(server.endpoint), timeout=5)
            handler = EtcdV3RendezvousHandler(client, "rides", Limits(2, 2, 15), "127.0.0.1")
            made.append((handler, client))
        (a, _), (b, _) = made
        joined: list[RendezvousInfo] = []
        waiting = threading.Thread(target=lambda: joined.append(a.next_rendezvous()))
        waiting.start()
        time.sleep(1.0)  # a is waiting for a second node when etcd goes down
        server.restart()
        (info_b,) = join_all(b)
        waiting.join(timeout=60)
        assert joined, "the waiting node never completed its join"
        assert {joined[0].rank, info_b.rank} == {0, 1}
        assert joined[0].world_size == info_b.world_size == 2
    finally:
        for handler, client in made:
            handler._leave()
            client.close()
        server.stop()


def test_nodes_meet_again_on_an_etcd_that_lost_its_data(tmp_path: Path) -> None:
    """A job's etcd pod replaced on an empty volume: the leases the nodes hold are gone,
    so they must take new ones instead of failing every write with "lease not found"."""
    server = start_etcd("3.5", tmp_path / "etcd")
    made: list[tuple[EtcdV3RendezvousHandler, EtcdClient]] = []
    try:
        for _ in range(2):
            client = EtcdClient(parse_endpoint(server.endpoint), timeout=5)
            handler = EtcdV3RendezvousHandler(
                client, "wiped", Limits(2, 2, 15), "127.0.0.1", join_timeout=60
            )
            made.append((handler, client))
        (a, _), (b, _) = made
        join_all(a, b)

        server.stop()
        shutil.rmtree(tmp_path / "etcd" / "data")
        server.restart()
        infos = join_all(a, b)
        assert sorted(i.rank for i in infos) == [0, 1]
        assert all(i.world_size == 2 for i in infos)
    finally:
        for handler, client in made:
            handler._leave()
            client.close()
        server.stop()
