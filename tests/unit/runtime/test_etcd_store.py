"""The store's decisions, without etcd: how a queue's items are laid out and counted,
and a timeout in torch's stores' words."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elasticjob_runtime.etcd.client import KeyValue
from elasticjob_runtime.rendezvous.etcd_store import (
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
