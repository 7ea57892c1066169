"""A ``torch.distributed.Store`` kept in etcd's v3 API.

torch's own ``EtcdStore`` needs the v2 API, which etcd 3.4 turns off and 3.6
removed. The agent uses this store for the per-round bookkeeping (rank
assignment, the master address, exit barrier); training traffic never goes
through it. Keys live under one prefix per round and carry the job's lease, so
they go away with the job. A write etcd refuses because it no longer knows that lease
(it lost its data: a new etcd pod on an empty volume) is written again at once under a
new one (``renew_lease``), never retried under the same one.

It keeps the contract torch holds its own stores to (TCPStore, FileStore, HashStore;
``tests/integration/rendezvous/test_torch_contracts.py`` checks it): a blocking read
that runs out raises ``DistStoreError`` in their words ("wait timeout after 250ms,
keys: ..."), ``clone()`` gives another store on the same keys, and the queue operations
work, each queued item being a key of its own.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from torch.distributed import (  # type: ignore[attr-defined]  # Store: not re-exported for mypy
    DistStoreError,
    QueueEmptyError,
    Store,
)

from elasticjob_runtime.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdTLSError,
    KeyValue,
)

log = logging.getLogger(__name__)


def _bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


GIVE_UP_POLL = 1.0  # seconds between give_up checks while a blocking read waits
# Between a queue's key and its items' ids: a NUL, which no c10d key holds, so a queue's
# items never share a prefix with another key ("foo"'s items are not "foobar"'s).
QUEUE_MARK = "\x00queue/"

T = TypeVar("T")


class RoundAbandoned(DistStoreError):
    """A blocking read gave up because the round it waited in can no longer happen."""


class AfterFailedWrite(enum.Enum):
    """What a store write that etcd failed does next."""

    RAISE = "raise"  # waiting will not help, and nothing else will
    NEW_LEASE = "new lease"  # write again at once, under the lease renew_lease gives
    WAIT = "wait"  # etcd is restarting or too busy: the same write will work later


def after_failed_write(exc: EtcdError, renewable: bool) -> AfterFailedWrite:
    """The rule for a failed write. A lease etcd no longer knows (it lost its data) fails
    every retry the same way: the store's writes once waited out the store's 300 s
    timeout on it, silently, while the node's peers waited for its rank-assignment role
    (the etcd-loss tests). A TLS mistake is not waited out either."""
    if isinstance(exc, EtcdTLSError):
        return AfterFailedWrite.RAISE
    if isinstance(exc, EtcdLeaseNotFound):
        return AfterFailedWrite.NEW_LEASE if renewable else AfterFailedWrite.RAISE
    return AfterFailedWrite.WAIT


def queue_prefix(full_key: str) -> str:
    """Where the items of the queue at ``full_key`` live, one key each: a push is one put
    (pushers never contend) and a pop one delete, which only one popper can win."""
    return full_key + QUEUE_MARK


def present_keys(names: Iterable[str]) -> frozenset[str]:
    """The store keys that are set, from the etcd keys under the prefix: plain keys, and
    queues holding at least one item (torch's ``check``, ``wait`` and ``num_keys`` count a
    non-empty queue as a key, an empty one as none)."""
    return frozenset(name.split(QUEUE_MARK, 1)[0] for name in names)


def queue_head(items: Iterable[KeyValue]) -> KeyValue | None:
    """The oldest item: every push is a put of a new key, so etcd's revisions order them."""
    return min(items, key=lambda kv: kv.mod_revision, default=None)


def milliseconds(duration: timedelta) -> str:
    """A duration as torch's stores print it ("250ms"); below 1 ms with its fraction."""
    ms = duration / timedelta(milliseconds=1)
    return f"{ms:.0f}ms" if ms >= 1 or ms == 0 else f"{ms:.3g}ms"


def timeout_message(waited: timedelta, keys: Sequence[str], why: str) -> str:
    """torch's words for a blocking read that ran out (TCPStore: "wait timeout after
    250ms, keys: a, b"), which people and scripts search logs for, then what etcd said."""
    return f"wait timeout after {milliseconds(waited)}, keys: {', '.join(keys)}; {why}"


@dataclass(frozen=True)
class _Waiting:
    """What a blocking read has not found yet, as of the etcd revision it read at."""

    revision: int
    keys: tuple[str, ...]
    why: str


class EtcdV3Store(Store):
    """Store semantics (blocking ``get``/``wait``, atomic ``add``/``compare_set``) on etcd."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        lease: int | None = None,
        timeout: timedelta = timedelta(seconds=300),
        renew_lease: Callable[[int], int] | None = None,
    ) -> None:
        """``renew_lease``: given the lease etcd refused, the lease to write under now (the
        rendezvous gives the run's, taken anew if it is still the refused one)."""
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._lease = lease
        self._renew_lease = renew_lease
        self._timeout = timeout
        super().set_timeout(timeout)
        # While set, blocking reads check it every GIVE_UP_POLL seconds and raise
        # RoundAbandoned with its reason: a peer that died before writing a key
        # would otherwise keep the others waiting for the whole timeout.
        self.give_up: Callable[[], str | None] | None = None
        self._clones: list[EtcdV3Store] = []  # see clone()

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        super().set_timeout(timeout)

    def clone(self) -> EtcdV3Store:
        """Another store on the same keys (torch's ``Store`` requires it: a process group's
        split or shrink wraps a clone of its store, threads take one each). It shares the
        etcd connection: a gRPC channel serves many threads at once, and a connection of its
        own would have nobody to close it. ``give_up`` is not copied: whoever set it on
        this store clears it here, and would leave it set on the clone.

        This store keeps its clones alive: torch's C++ side (``PrefixStore``) may hold one
        with no Python reference, and pybind11 forgets a Python store's methods once its
        last one goes (every call then fails with "Not implemented")."""
        clone = EtcdV3Store(
            self._client, self._prefix, self._lease, self._timeout, self._renew_lease
        )
        self._clones.append(clone)
        return clone

    def set(self, key: str, value: str | bytes) -> None:
        self._put(self._key(key), _bytes(value))

    def _put(self, full_key: str, value: bytes) -> None:
        """A put, tried again until the store's timeout while etcd fails it: an etcd that
        is restarting, or too busy to apply writes in time ("request timed out", seen at
        1024 agents on 2 cores), must not fail the round when rank 0 writes its address,
        which every other rank waits for. A put is idempotent; a lost lease and a TLS
        mistake are not waited out (:func:`after_failed_write`)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        renew = False
        while True:
            try:
                if renew:
                    self._take_new_lease()
                    renew = False
                self._client.put(full_key, value, lease=self._lease)
                return
            except EtcdError as exc:
                action = after_failed_write(exc, self._renewable)
                if action is AfterFailedWrite.RAISE or time.monotonic() >= deadline:
                    raise
                if action is AfterFailedWrite.NEW_LEASE:
                    renew = True
                else:
                    time.sleep(0.5)

    def _compare_and_set(
        self, full_key: str, value: bytes, current: KeyValue | None
    ) -> tuple[bool, KeyValue | None]:
        """:meth:`EtcdClient.compare_and_set` against ``current`` under the store's lease,
        again under a new one if etcd no longer knows it."""
        revision = None if current is None else current.mod_revision
        try:
            return self._client.compare_and_set(full_key, value, revision, self._lease)
        except EtcdError as exc:
            if after_failed_write(exc, self._renewable) is not AfterFailedWrite.NEW_LEASE:
                raise
            self._take_new_lease()
            return self._client.compare_and_set(full_key, value, revision, self._lease)

    @property
    def _renewable(self) -> bool:
        return self._renew_lease is not None and self._lease is not None

    def _take_new_lease(self) -> None:
        """etcd refused the store's lease: write under the one ``renew_lease`` gives."""
        assert self._renew_lease is not None and self._lease is not None
        refused, self._lease = self._lease, self._renew_lease(self._lease)
        log.warning(
            "etcd-v3: etcd no longer knows lease %x of the store under %s (it lost its "
            "data?); writing under lease %x",
            refused,
            self._prefix,
            self._lease,
        )

    def get(self, key: str) -> bytes:
        return self._block([key], self._timeout, self._prefix, lambda: self._values([key]))[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._block(keys, self._timeout, self._prefix, lambda: self._values(keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        current = self._client.get(full)
        while True:
            base = int(current.value) if current is not None else 0
            ok, now = self._compare_and_set(full, str(base + amount).encode(), current)
            if ok:
                return base + amount
            current = now

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """c10d semantics: set if equal to ``expected`` (or absent, when ``expected`` is empty)."""
        full = self._key(key)
        expected = _bytes(expected_value)
        desired = _bytes(desired_value)
        current = self._client.get(full)
        while True:
            if current is None:
                if expected:
                    return expected
            elif current.value != expected:
                return current.value
            ok, now = self._compare_and_set(full, desired, current)
            if ok:
                return desired
            current = now

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set now (a queue counts while it holds items): one read."""
        present = present_keys(self._client.snapshot(self._prefix).items)
        return all(self._key(k) in present for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key is set (a queue counts once it holds an item), or the timeout."""
        self._block(
            keys,
            timeout if timeout is not None else self._timeout,
            self._prefix,
            lambda: self._missing(keys),
        )

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        """The keys set, a non-empty queue counting as one (as in torch's HashStore)."""
        return len(present_keys(self._client.snapshot(self._prefix).items))

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the queue ``key``: a put of a key of its own, ridden out
        like :meth:`set` while etcd fails it (the same key again, so never twice)."""
        self._put(queue_prefix(self._key(key)) + uuid.uuid4().hex, _bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the oldest item of the queue ``key``; while it is empty wait up to the
        store's timeout, or with ``block=False`` raise ``QueueEmptyError`` at once."""
        if block:
            return self._block([key], self._timeout, queue_prefix(self._key(key)), self._take(key))
        got = self._take(key)()
        if isinstance(got, _Waiting):
            raise QueueEmptyError(f"queue is empty: {key}; {got.why}")
        return got

    def queue_len(self, key: str) -> int:
        """How many items the queue ``key`` holds; 0 for a queue never pushed to."""
        return len(self._client.snapshot(queue_prefix(self._key(key))).items)

    def _take(self, key: str) -> Callable[[], bytes | _Waiting]:
        """One attempt at popping: delete the oldest item's key. etcd deletes a key once,
        so of two poppers after the same item only one is told it deleted it; the other
        looks again."""
        items = queue_prefix(self._key(key))

        def attempt() -> bytes | _Waiting:
            while True:
                snap = self._client.snapshot(items)
                head = queue_head(snap.items.values())
                if head is None:
                    return _Waiting(snap.revision, (key,), self._where("the queue is empty"))
                if self._client.delete(head.key):
                    return head.value

        return attempt

    def _values(self, keys: Sequence[str]) -> list[bytes] | _Waiting:
        """The keys' values from one read, or what is still missing."""
        snap = self._client.snapshot(self._prefix)
        missing = tuple(k for k in keys if self._key(k) not in snap.items)
        if missing:
            return _Waiting(snap.revision, missing, self._where("not set"))
        return [snap.items[self._key(k)].value for k in keys]

    def _missing(self, keys: Sequence[str]) -> _Waiting | None:
        """Nothing once every key is set (queues included), else what is still missing."""
        snap = self._client.snapshot(self._prefix)
        present = present_keys(snap.items)
        missing = tuple(k for k in keys if self._key(k) not in present)
        return _Waiting(snap.revision, missing, self._where("not set")) if missing else None

    def _where(self, what: str) -> str:
        return f"{what} under {self._prefix} in etcd at {self._client.where}"

    def _block(
        self,
        keys: Sequence[str],
        timeout: timedelta,
        watched: str,
        attempt: Callable[[], T | _Waiting],
    ) -> T:
        """Repeat ``attempt`` at every change under ``watched`` until it finds what it
        waits for or ``timeout`` runs out; an etcd outage shorter than that is ridden out."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                got = attempt()
                if not isinstance(got, _Waiting):
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistStoreError(timeout_message(timeout, got.keys, got.why))
                if self.give_up is not None:
                    reason = self.give_up()
                    if reason is not None:
                        raise RoundAbandoned(reason)
                    left = min(left, GIVE_UP_POLL)
                self._client.wait_for_change(watched, got.revision, left)
            except EtcdError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f"etcd did not answer: {exc}"
                    raise DistStoreError(timeout_message(timeout, keys, why)) from exc
                time.sleep(min(0.5, left))
