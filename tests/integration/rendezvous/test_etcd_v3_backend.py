"""The etcd-v3 backend and Store against real etcd 3.5 and 3.6 (the devcluster build)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import EtcdServer, start_etcd
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from elasticjob_runtime.etcd.client import Change, EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.backend import EtcdV3RendezvousBackend
from elasticjob_runtime.rendezvous.etcd_store import EtcdV3Store
from elasticjob_runtime.rendezvous.keys import state_key

pytestmark = pytest.mark.integration


def client_for(server: EtcdServer) -> EtcdClient:
    return EtcdClient(parse_endpoints(server.endpoint), timeout=10)


def test_backend_compare_and_set_rejects_stale_tokens(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    client = client_for(etcd_any)
    run = f"cas-{request.node.name}"
    backend = EtcdV3RendezvousBackend(client, run)
    assert backend.get_state() is None

    created = backend.set_state(b"one")
    assert created is not None and created[0] == b"one" and created[2] is True
    # A second creator (token None) loses and is handed the state that won.
    again = backend.set_state(b"other")
    assert again is not None and again[:2] == created[:2] and again[2] is False

    _, token = backend.get_state() or (b"", None)
    winner = backend.set_state(b"two", token)
    assert winner is not None and winner[0] == b"two" and winner[2] is True
    stale = backend.set_state(b"three", token)
    assert stale is not None and stale[0] == b"two" and stale[1] == winner[1] and stale[2] is False
    assert backend.get_state() == (b"two", winner[1])
    client.close()


def test_backend_loses_no_update_under_concurrent_writers(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    run = f"race-{request.node.name}"
    writers, increments = 4, 25
    errors: list[BaseException] = []

    def bump() -> None:
        client = client_for(etcd_any)
        backend = EtcdV3RendezvousBackend(client, run)
        try:
            for _ in range(increments):
                got = backend.get_state()
                value, token = (int(got[0]), got[1]) if got else (0, None)
                while True:
                    result = backend.set_state(str(value + 1).encode(), token)
                    assert result is not None
                    if result[2]:
                        break
                    value, token = int(result[0]), result[1]
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=bump) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    final = EtcdV3RendezvousBackend(client_for(etcd_any), run).get_state()
    assert final is not None and int(final[0]) == writers * increments


def test_wait_for_change_wakes_on_a_change_and_never_sleeps_out_a_long_timeout(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    client = client_for(etcd_any)
    prefix = f"wait-{request.node.name}/"
    revision = client.snapshot(prefix).revision
    threading.Timer(0.3, lambda: client.put(prefix + "k", b"v")).start()
    assert client.wait_for_change(prefix, revision, 60)

    # Nothing changes: callers re-read on every return, so it comes back after
    # RECHECK_AFTER rather than at the caller's (here ten-minute) deadline.
    started = time.monotonic()
    assert not client.wait_for_change(prefix, client.snapshot(prefix).revision, 600)
    assert time.monotonic() - started < 60


def test_a_put_between_the_read_and_the_wait_ends_the_wait_at_once(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    # The awaited key is written after the caller's read and before its watch exists:
    # etcd hands such a watch its first event only from its 100 ms catch-up loop, so a
    # wait with no time to spare (timeout 0) used to see nothing at all.
    client, writer = client_for(etcd_any), client_for(etcd_any)
    prefix = f"race-{request.node.name}/"
    for n in range(5):
        revision = client.snapshot(prefix).revision
        writer.put(f"{prefix}round/{n}/k", b"v")
        assert client.wait_for_change([prefix + "round/", prefix + "other/"], revision, 0)
    # a key beside the awaited ones, written before the read: not a change after it
    writer.put(prefix + "beside", b"v")
    assert not client.wait_for_change(prefix + "round/", client.snapshot(prefix).revision, 0)


def test_compare_and_set_writes_its_extra_keys_only_when_it_wins(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    # The leader seals a round and writes its sealed record in one transaction: a
    # record without the seal (or the reverse) would let nodes disagree on the round.
    client = client_for(etcd_any)
    base = f"cas-{request.node.name}/"
    ok, kv = client.compare_and_set(base + "state", b"1", None, also={base + "sealed/1": b"a"})
    assert ok and kv is not None and client.get(base + "sealed/1") is not None
    stale = kv.mod_revision
    client.put(base + "state", b"2")
    ok, now = client.compare_and_set(base + "state", b"3", stale, also={base + "sealed/2": b"b"})
    assert not ok and now is not None and now.value == b"2"
    assert client.get(base + "sealed/2") is None


def test_a_wait_wakes_on_a_change_under_any_of_its_prefixes_and_a_watch_names_the_keys(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    client = client_for(etcd_any)
    base = f"multi-{request.node.name}/"
    revision = client.snapshot(base).revision
    client.put(base + "joins/a", b"")
    assert client.wait_for_change([base + "state", base + "joins/"], revision, 60)

    seen: list[Change] = []
    got = threading.Event()
    cancel = client.watch_prefix(
        base, client.snapshot(base).revision + 1, got.set, on_keys=seen.extend
    )
    try:
        client.delete(base + "joins/a")
        assert got.wait(30)
    finally:
        cancel()
    assert Change(base + "joins/a", deleted=True) in seen


def test_backend_state_lives_under_the_run_prefix_and_goes_with_its_lease(
    etcd_any: EtcdServer,
) -> None:
    client = client_for(etcd_any)
    lease = client.grant(60)
    backend = EtcdV3RendezvousBackend(client, "leased-run", lease=lease)
    backend.set_state(b"x")
    kv = client.get(state_key("leased-run"))
    assert kv is not None and kv.key.startswith("/elasticjob/leased-run/") and kv.lease == lease
    client.revoke(lease)
    assert backend.get_state() is None
    client.close()


def test_store_blocking_get_add_compare_set_and_timeouts(etcd_any: EtcdServer) -> None:
    client = client_for(etcd_any)
    store = EtcdV3Store(client, "/elasticjob/store-test/", timeout=timedelta(seconds=20))
    other = EtcdV3Store(client_for(etcd_any), "/elasticjob/store-test/")

    threading.Timer(0.5, lambda: other.set("late", b"arrived")).start()
    started = time.monotonic()
    assert store.get("late") == b"arrived"
    assert time.monotonic() - started < 15

    store.set_timeout(timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError, match="never"):
        store.get("never")
    store.set_timeout(timedelta(seconds=20))

    counters: list[int] = []
    threads = [
        threading.Thread(target=lambda: counters.extend(store.add("n", 1) for _ in range(10)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(counters) == list(range(1, 31))

    assert store.compare_set("cs", "", "first") == b"first"
    assert store.compare_set("cs", "wrong", "second") == b"first"
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.compare_set("absent", "expected", "x") == b"expected"

    store.multi_set(["m1", "m2"], [b"1", "2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert store.check(["m1", "m2"]) and not store.check(["m1", "nope"])
    store.wait(["m1", "late"])
    assert store.num_keys() == 5  # late, n, cs, m1, m2
    assert store.delete_key("m1") and not store.check(["m1"])
    client.close()


def test_a_store_write_rides_out_an_etcd_that_is_down_for_a_moment(tmp_path: Path) -> None:
    # Rank 0 writes the round's address into the store and every other rank waits for it:
    # one failed put (a restart, an etcd too busy to apply it in time) stranded a round.
    server = start_etcd("3.5", tmp_path / "etcd")
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=2, reconnect_within=0.5)
    try:
        store = EtcdV3Store(client, "/elasticjob/store-outage/", timeout=timedelta(seconds=60))
        server.stop()
        back = threading.Timer(2.0, server.restart)
        back.start()
        store.set("MASTER_ADDR", "10.0.0.1")
        back.join()
        assert client.get("/elasticjob/store-outage/MASTER_ADDR") is not None
    finally:
        client.close()
        server.stop()


def test_torch_dynamic_rendezvous_handler_runs_on_the_backend_and_store(
    etcd_any: EtcdServer, request: pytest.FixtureRequest
) -> None:
    # The backend keeps torch's RendezvousBackend contract, so torch's own handler
    # (heartbeats, last call and all) works on it unchanged.
    run = f"dynamic-{request.node.callspec.id}"
    clients = [client_for(etcd_any) for _ in range(2)]
    handlers = [
        DynamicRendezvousHandler.from_backend(
            run_id=run,
            store=EtcdV3Store(c, f"/elasticjob/{run}/store/"),
            backend=EtcdV3RendezvousBackend(c, run),
            min_nodes=2,
            max_nodes=2,
            local_addr="127.0.0.1",
        )
        for c in clients
    ]
    results: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def join(h: DynamicRendezvousHandler) -> None:
        try:
            info = h.next_rendezvous()
            results.append((info.rank, info.world_size))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert sorted(results) == [(0, 2), (1, 2)]
    for h in handlers:
        h.shutdown()
    for c in clients:
        c.close()
