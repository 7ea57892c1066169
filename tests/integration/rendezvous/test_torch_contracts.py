"""The contracts torch holds its own rendezvous backends and stores to, held against ours
on a real etcd (3.5 and 3.6).

torch checks its backends (C10dRendezvousBackend, EtcdRendezvousBackend) for what
``get_state``/``set_state`` return and raise, and its stores (TCPStore, FileStore,
HashStore) for set/get/add/check, compare_set, timeouts, ``clone`` and the queues. These
tests are ours, written to those expectations; torch's code under test/ is not used.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import EtcdServer, start_etcd
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.backend import EtcdV3RendezvousBackend
from elasticjob_runtime.rendezvous.etcd_store import EtcdV3Store
from elasticjob_runtime.rendezvous.keys import state_key

pytestmark = pytest.mark.integration


@pytest.fixture
def client(etcd_any: EtcdServer) -> Iterator[EtcdClient]:
    opened = EtcdClient(parse_endpoints(etcd_any.endpoint), timeout=10)
    yield opened
    opened.close()


@pytest.fixture
def run(request: pytest.FixtureRequest) -> str:
    """A run id of the test's own (with the etcd version), so tests never share a state."""
    return "contract-" + request.node.name.replace("[", "-").rstrip("]")


@pytest.fixture
def backend(client: EtcdClient, run: str) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(client, run)


@pytest.fixture
def store(client: EtcdClient, run: str) -> EtcdV3Store:
    # torch's store tests give their stores a long timeout and shorten it where they test it
    return EtcdV3Store(client, f"/elasticjob/{run}/store/", timeout=timedelta(seconds=300))


def written(result: tuple[bytes, object, bool] | None) -> tuple[bytes, object, bool]:
    assert result is not None, "set_state returned None over a state that exists"
    return result


# -- the backend: RendezvousBackend's contract


def test_get_state_returns_the_state_written_and_a_token(
    backend: EtcdV3RendezvousBackend,
) -> None:
    backend.set_state(b"x")
    got = backend.get_state()
    assert got is not None
    state, token = got
    assert state == b"x" and token is not None


def test_get_state_is_none_before_any_state_is_written(backend: EtcdV3RendezvousBackend) -> None:
    assert backend.get_state() is None


def test_a_value_put_on_the_state_key_by_something_else_is_a_corrupt_state(
    backend: EtcdV3RendezvousBackend, client: EtcdClient, run: str
) -> None:
    # torch's own test writes a value its backend cannot decode straight onto the key
    client.put(state_key(run), b"non_base64")
    with pytest.raises(RendezvousStateError, match="is corrupt") as raised:
        backend.get_state()
    assert state_key(run) in str(raised.value) and "missing" in str(raised.value)


def test_a_state_overwritten_behind_the_backends_back_is_a_corrupt_state(
    backend: EtcdV3RendezvousBackend, client: EtcdClient, run: str
) -> None:
    backend.set_state(b"the round")
    client.put(state_key(run), b"the round, edited by hand")
    with pytest.raises(RendezvousStateError, match="overwrote") as raised:
        backend.get_state()
    message = str(raised.value)
    assert state_key(run) in message and f"etcdctl del --prefix /elasticjob/{run}/" in message


def test_set_state_writes_a_state_where_there_is_none(backend: EtcdV3RendezvousBackend) -> None:
    state, token, has_set = written(backend.set_state(b"x"))
    assert (state, has_set) == (b"x", True) and token is not None


def test_set_state_with_the_current_token_replaces_the_state_and_its_token(
    backend: EtcdV3RendezvousBackend,
) -> None:
    _, first_token, _ = written(backend.set_state(b"x"))
    state, token, has_set = written(backend.set_state(b"y", first_token))
    assert (state, has_set) == (b"y", True) and token != first_token
    assert backend.get_state() == (b"y", token)


def test_set_state_with_an_old_token_writes_nothing_and_returns_the_state_that_won(
    backend: EtcdV3RendezvousBackend,
) -> None:
    _, old, _ = written(backend.set_state(b"x"))
    winner, winner_token, _ = written(backend.set_state(b"y", old))
    assert written(backend.set_state(b"z", old)) == (winner, winner_token, False)


@pytest.mark.parametrize("token", [None, "invalid"], ids=["no-token", "foreign-token"])
def test_set_state_without_a_token_of_ours_over_a_state_returns_that_state(
    backend: EtcdV3RendezvousBackend, token: object
) -> None:
    state, current, _ = written(backend.set_state(b"x"))
    assert written(backend.set_state(b"y", token)) == (state, current, False)


def test_an_etcd_that_is_down_is_a_connection_error_to_the_backend_and_a_timeout_to_the_store(
    tmp_path: Path,
) -> None:
    server = start_etcd("3.5", tmp_path / "etcd")
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=2, reconnect_within=0.5)
    try:
        backend = EtcdV3RendezvousBackend(client, "down-run")
        store = EtcdV3Store(client, "/elasticjob/down-run/store/")
        _, token, _ = written(backend.set_state(b"x"))
        server.stop()
        where = re.escape(server.endpoint)
        with pytest.raises(RendezvousConnectionError, match=where):
            backend.get_state()
        with pytest.raises(RendezvousConnectionError, match=where):
            backend.set_state(b"y", token)
        with pytest.raises(dist.DistStoreError, match="wait timeout after 1000ms, keys: k;") as e:
            store.wait(["k"], timedelta(seconds=1))
        assert f"etcd did not answer: etcd at {server.endpoint}" in str(e.value)
        # a connection error, not a lost state: once etcd is back, so is the state
        server.restart()
        assert read_when_reconnected(backend) == (b"x", token)
    finally:
        client.close()
        server.stop()


def read_when_reconnected(backend: EtcdV3RendezvousBackend) -> tuple[bytes, object] | None:
    """get_state once the client has its connection back (gRPC retries on its own backoff)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return backend.get_state()
        except RendezvousConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- the store: torch.distributed.Store's contract


def test_set_get_add_check_num_keys_and_delete_key(store: EtcdV3Store) -> None:
    for amount in (1, 2, 3):
        store.add("key", amount)
    store.set("key0", "value0")
    store.set("key1", "value1")
    store.set("key2", b"value2")
    assert [store.add("key3", n) for n in range(1, 7)][-1] == 21
    assert store.num_keys() == 5
    assert store.get("key") == b"6" and store.get("key3") == b"21"
    assert store.multi_get(["key0", "key1", "key2"]) == [b"value0", b"value1", b"value2"]
    assert store.check(["key3"]) and not store.check(["Randomkey3"])
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    assert store.delete_key("-key3") and not store.delete_key("-key3")
    assert store.num_keys() == 5


def test_compare_set_sets_only_over_the_expected_value(store: EtcdV3Store) -> None:
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    assert not store.check(["cs_key0"])
    store.set("cs_key0", "value0")
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


def test_a_wait_that_runs_out_says_timeout_how_long_and_which_keys(
    store: EtcdV3Store, etcd_any: EtcdServer
) -> None:
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError) as raised:
        store.wait(["bad_key", "other"], timedelta(seconds=0.25))
    assert time.monotonic() - started >= 0.25
    message = str(raised.value)
    assert message.startswith("wait timeout after 250ms, keys: bad_key, other;"), message
    assert etcd_any.endpoint in message
    store.add("good_key", 1)
    store.wait(["good_key"])

    store.set_timeout(timedelta(seconds=0.25))  # get and multi_get wait as long
    with pytest.raises(dist.DistStoreError, match=r"^wait timeout after 250ms, keys: bad_key;"):
        store.get("bad_key")
    with pytest.raises(dist.DistStoreError, match="keys: bad_key;"):
        store.multi_get(["good_key", "bad_key"])


def test_a_clone_is_another_store_on_the_same_keys(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=7))
    clone = store.clone()
    assert isinstance(clone, dist.Store) and clone is not store
    assert clone.timeout == timedelta(seconds=7)
    store.set("foo", "bar")
    assert clone.get("foo") == b"bar"
    clone.set("back", "and forth")
    assert store.get("back") == b"and forth"
    # torch's C++ side holds clones too (a process group's split or shrink wraps one in a
    # PrefixStore), with no Python reference left to them
    grouped = dist.PrefixStore("group", store.clone())
    gc.collect()
    grouped.set("k", "v")
    assert store.get("group/k") == b"v"
    cloned_in_cpp = dist.PrefixStore("group", store).clone()
    gc.collect()
    assert cloned_in_cpp.get("k") == b"v"


def test_a_queue_pops_in_push_order_and_counts_as_a_key_while_it_holds_items(
    store: EtcdV3Store,
) -> None:
    assert not store.check(["foo"]) and store.queue_len("foo") == 0
    store.queue_push("foo", "1")
    store.queue_push("foo", b"2")
    assert store.check(["foo"]) and store.queue_len("foo") == 2
    store.wait(["foo"])
    assert store.num_keys() == 1  # one queue, two items
    assert store.queue_pop("foo") == b"1"
    assert store.queue_pop("foo") == b"2"
    assert not store.check(["foo"]) and store.queue_len("foo") == 0
    assert store.num_keys() == 0
    store.queue_push("foobar", "x")  # a queue whose name starts with another's
    assert store.queue_len("foo") == 0 and store.queue_len("foobar") == 1


def test_a_non_blocking_pop_of_an_empty_queue_says_it_is_empty(store: EtcdV3Store) -> None:
    with pytest.raises(dist.QueueEmptyError, match="empty: foo;"):
        store.queue_pop("foo", block=False)
    store.queue_push("foo", "a")
    assert store.queue_pop("foo", block=False) == b"a"


def test_a_blocking_pop_of_an_empty_queue_times_out(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=0.01))
    with pytest.raises(dist.DistStoreError, match=r"^wait timeout after 10ms, keys: never;"):
        store.queue_pop("never")


def test_clones_in_two_threads_talk_through_queues(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=60))

    def first() -> bytes:
        mine = store.clone()
        mine.queue_push("a", "a1")
        return mine.queue_pop("b")  # blocks until the other thread answers

    def second() -> bytes:
        mine = store.clone()
        got = mine.queue_pop("a")
        mine.queue_push("b", "b1")
        return got

    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = [pool.submit(first), pool.submit(second)]
        assert [f.result(timeout=120) for f in answers] == [b"b1", b"a1"]


def test_every_item_goes_to_exactly_one_of_several_poppers(store: EtcdV3Store) -> None:
    items = [str(i).encode() for i in range(24)]
    for item in items:
        store.queue_push("work", item)
    taken: list[bytes] = []
    lock = threading.Lock()

    def pop_eight() -> None:
        mine = store.clone()
        for _ in range(8):
            got = mine.queue_pop("work")
            with lock:
                taken.append(got)

    with ThreadPoolExecutor(max_workers=3) as pool:
        for f in [pool.submit(pop_eight) for _ in range(3)]:
            f.result(timeout=120)
    assert sorted(taken) == sorted(items)
    assert store.queue_len("work") == 0
