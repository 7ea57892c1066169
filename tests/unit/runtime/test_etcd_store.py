"""The store's decisions, without etcd: how a queue's items are laid out and counted,
a timeout in torch's stores' words, and what a write etcd failed does next."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, cast

import pytest

from elasticjob_runtime.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdTLSError,
    KeyValue,
)
from elasticjob_runtime.rendezvous.etcd_store import (
    AfterFailedWrite,
    EtcdV3Store,
    after_failed_write,
    milliseconds,
    present_keys,
    queue_head,
    queue_prefix,
    timeout_message,
)


@pytest.mark.parametrize(
    ("duration", "text"),
    [
        (timedelta(seconds=0.25), "250ms"),  # printed "0s" before
        (timedelta(seconds=0.01), "10ms"),
        (timedelta(seconds=300), "300000ms"),
        (timedelta(microseconds=500), "0.5ms"),
        (timedelta(0), "0ms"),
    ],
)
def test_a_duration_reads_as_torchs_stores_print_it(duration: timedelta, text: str) -> None:
    assert milliseconds(duration) == text


def test_a_timeout_uses_torchs_words_then_says_what_etcd_lacked() -> None:
    message = timeout_message(
        timedelta(seconds=0.25), ["bad_key", "other"], "not set under /p/ in etcd at h:2379"
    )
    # TCPStore: "wait timeout after 250ms, keys: /bad_key, /other"
    assert message == (
        "wait timeout after 250ms, keys: bad_key, other; not set under /p/ in etcd at h:2379"
    )


def test_a_queue_counts_as_one_key_while_it_holds_items() -> None:
    foo_items = [queue_prefix("/p/foo") + item for item in ("a1", "b2")]
    present = present_keys(["/p/plain", *foo_items, queue_prefix("/p/foobar") + "c3"])
    assert present == {"/p/plain", "/p/foo", "/p/foobar"}
    assert "/p/empty" not in present_keys([])


def test_a_queues_items_never_share_a_prefix_with_another_key() -> None:
    assert not queue_prefix("/p/foobar").startswith(queue_prefix("/p/foo"))
    assert not (queue_prefix("/p/foo") + "x").startswith("/p/foo/")


def test_the_head_of_a_queue_is_its_oldest_push() -> None:
    def item(name: str, revision: int) -> KeyValue:
        return KeyValue(queue_prefix("/p/q") + name, name.encode(), revision, 0)

    # ids are random: etcd's revision of each put is the order, not the key
    assert queue_head([item("ff", 12), item("00", 15), item("aa", 9)]) == item("aa", 9)
    assert queue_head([]) is None


LOST = EtcdLeaseNotFound(
    "etcd at h:2379: put k failed (NOT_FOUND: etcdserver: requested lease not found)"
)


@pytest.mark.parametrize("renewable", [True, False])
def test_a_write_under_a_lease_etcd_lost_is_never_retried_under_it(renewable: bool) -> None:
    # every retry under it fails the same way: the store once waited out its 300 s here
    expected = AfterFailedWrite.NEW_LEASE if renewable else AfterFailedWrite.RAISE
    assert after_failed_write(LOST, renewable) is expected


def test_an_etcd_that_is_away_or_busy_is_waited_out_and_a_tls_mistake_is_not() -> None:
    away = EtcdError("etcd at h:2379: put k failed (UNAVAILABLE: failed to connect)")
    assert after_failed_write(away, renewable=True) is AfterFailedWrite.WAIT
    tls = EtcdTLSError("cannot connect to etcd at h:2379 over TLS: ...")
    assert after_failed_write(tls, renewable=True) is AfterFailedWrite.RAISE


class LostLeaseEtcd:
    """An etcd that lost its data: it refuses every write under ``lost``."""

    def __init__(self, lost: int) -> None:
        self.lost = lost
        self.kvs: dict[str, KeyValue] = {}
        self.where = "h:2379"

    def _check(self, lease: int | None) -> None:
        if lease == self.lost:
            raise LOST

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        self._check(lease)
        self.kvs[key] = KeyValue(key, value, len(self.kvs) + 1, lease or 0)

    def get(self, key: str) -> KeyValue | None:
        return self.kvs.get(key)

    def compare_and_set(
        self, key: str, value: bytes, mod_revision: int | None, lease: int | None = None
    ) -> tuple[bool, KeyValue | None]:
        self._check(lease)
        current = self.kvs.get(key)
        if (current.mod_revision if current else None) != mod_revision:
            return False, current
        self.put(key, value, lease)
        return True, self.kvs[key]


def test_a_store_whose_lease_etcd_lost_writes_under_a_new_one_at_once() -> None:
    """The etcd-loss race: a round's store took the run's lease when the round started,
    before the node had replaced it; its rank-assignment role was then retried under the
    lost lease for the store's timeout, while the round's other nodes waited for it."""
    etcd = LostLeaseEtcd(lost=7)
    asked: list[int] = []

    def renew(refused: int) -> int:
        asked.append(refused)
        return 8

    store = EtcdV3Store(
        cast(EtcdClient, etcd), "/r/store/", 7, timedelta(seconds=5), renew_lease=renew
    )
    started = time.monotonic()
    store.set("torchelastic/role_info/1", b"role")
    assert time.monotonic() - started < 0.4  # not a retry after another
    assert etcd.kvs["/r/store/torchelastic/role_info/1"].lease == 8
    assert asked == [7]
    # the later writes (torch's barriers count with add) use the new lease from the start
    assert store.add("barrier", 1) == 1
    assert etcd.kvs["/r/store/barrier"].lease == 8
    assert asked == [7]


@pytest.mark.parametrize("write", ["add", "compare_set", "clone's set"])
def test_every_kind_of_write_takes_a_new_lease_when_etcd_lost_the_stores(write: str) -> None:
    etcd = LostLeaseEtcd(lost=7)
    store = EtcdV3Store(cast(EtcdClient, etcd), "/r/", 7, renew_lease=lambda refused: refused + 1)
    do: dict[str, Any] = {
        "add": lambda: store.add("k", 2),
        "compare_set": lambda: store.compare_set("k", b"", b"v"),
        "clone's set": lambda: store.clone().set("k", b"v"),
    }
    do[write]()
    assert etcd.kvs["/r/k"].lease == 8


def test_a_store_that_cannot_renew_its_lease_fails_at_once_instead_of_waiting() -> None:
    store = EtcdV3Store(cast(EtcdClient, LostLeaseEtcd(lost=7)), "/r/", 7, timedelta(seconds=5))
    started = time.monotonic()
    with pytest.raises(EtcdLeaseNotFound):
        store.set("k", b"v")
    assert time.monotonic() - started < 0.4
