"""Deleted jobs' children go in batches: a burst of deletions is one call per namespace,
never more uids in one selector than fit, and a failed batch does not stop the next."""

from __future__ import annotations

import threading

import pytest

from elasticjob_operator.deletions import Deletions, batches
from elasticjob_operator.kube import uid_selector


def test_a_burst_is_one_batch_per_namespace_of_at_most_fifty_uids() -> None:
    pending = {"a": [f"u{i}" for i in range(120)], "b": ["x", "x", "y"]}
    got = batches(pending)
    assert [(ns, len(uids)) for ns, uids in got] == [("a", 50), ("a", 50), ("a", 20), ("b", 2)]
    assert got[-1] == ("b", ["x", "y"])  # a uid twice (two DELETED events) once


def test_the_selector_names_every_uid_of_the_batch() -> None:
    assert uid_selector(["u1"]) == "elastic.pytorch.org/job-uid=u1"
    assert uid_selector(["u1", "u2"]) == "elastic.pytorch.org/job-uid in (u1,u2)"
    with pytest.raises(ValueError):
        uid_selector([])


def test_deletions_arriving_together_are_handed_over_together() -> None:
    calls: list[tuple[str, list[str]]] = []
    done = threading.Event()

    def delete(namespace: str, uids: list[str]) -> None:
        calls.append((namespace, uids))
        if namespace == "fails":
            raise RuntimeError("the API server said no")
        done.set()

    deletions = Deletions(delete, gather=0.2)
    deletions.start()
    try:
        deletions.add("fails", "f1")
        for i in range(5):
            deletions.add("ml", f"u{i}")
        assert done.wait(timeout=30)
        assert calls == [("fails", ["f1"]), ("ml", ["u0", "u1", "u2", "u3", "u4"])]
        done.clear()
        deletions.add("ml", "later")  # the batcher goes on after a failed batch
        assert done.wait(timeout=30)
        assert calls[-1] == ("ml", ["later"])
    finally:
        deletions.stop()
