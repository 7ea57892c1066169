"""A ``torch.distributed.Store`` kept in etcd's v3 API.

torch's own ``EtcdStore`` needs the v2 API, which etcd 3.4 turns off and 3.6
removed. The agent uses this store for the per-round bookkeeping (rank
assignment, the master address, exit barrier); training traffic never goes
through it. Keys live under one prefix per round and carry the job's lease, so
they go away with the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from torch._C._distributed_c10d import Store
from torch.distributed import DistStoreError

from elasticjob_runtime.etcd_client import EtcdClient, EtcdError, EtcdTLSError


def _bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


GIVE_UP_POLL = 1.0  # seconds between give_up checks while a blocking read waits


class RoundAbandoned(DistStoreError):
    """A blocking read gave up because the round it waited in can no longer happen."""


class EtcdV3Store(Store):
    """Store semantics (blocking ``get``/``wait``, atomic ``add``/``compare_set``) on etcd."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        lease: int | None = None,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._lease = lease
        self._timeout = timeout
        super().set_timeout(timeout)
        # While set, blocking reads check it every GIVE_UP_POLL seconds and raise
        # RoundAbandoned with its reason: a peer that died before writing a key
        # would otherwise keep the others waiting for the whole timeout.
        self.give_up: Callable[[], str | None] | None = None

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        super().set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        """A put, tried again until the store's timeout while etcd fails it: an etcd that
        is restarting, or too busy to apply writes in time ("request timed out", seen at
        1024 agents on 2 cores), must not fail the round when rank 0 writes its address,
        which every other rank waits for. A put is idempotent; a TLS mistake is not
        waited out."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                self._client.put(self._key(key), _bytes(value), lease=self._lease)
                return
            except EtcdTLSError:
                raise
            except EtcdError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def get(self, key: str) -> bytes:
        return self._wait_all([key], self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_all(keys, self._timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        current = self._client.get(full)
        while True:
            base = int(current.value) if current is not None else 0
            ok, now = self._client.compare_and_set(
                full,
                str(base + amount).encode(),
                None if current is None else current.mod_revision,
                self._lease,
            )
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
            ok, now = self._client.compare_and_set(
                full, desired, None if current is None else current.mod_revision, self._lease
            )
            if ok:
                return desired
            current = now

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_all(keys, timeout if timeout is not None else self._timeout)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        return len(self._client.snapshot(self._prefix).items)

    def _wait_all(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        """Wait for all ``keys``; an etcd outage shorter than the timeout is ridden out."""
        deadline = time.monotonic() + timeout.total_seconds()
        wanted = [self._key(k) for k in keys]
        while True:
            try:
                snap = self._client.snapshot(self._prefix)
                missing = [k for k in wanted if k not in snap.items]
                if not missing:
                    return [snap.items[k].value for k in wanted]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistStoreError(
                        f"timed out after {timeout.total_seconds():.0f}s waiting for etcd keys "
                        f"{', '.join(missing)}"
                    )
                if self.give_up is not None:
                    reason = self.give_up()
                    if reason is not None:
                        raise RoundAbandoned(reason)
                    left = min(left, GIVE_UP_POLL)
                self._client.wait_for_change(self._prefix, snap.revision, left)
            except EtcdError as exc:
                if time.monotonic() >= deadline:
                    raise DistStoreError(str(exc)) from exc
                time.sleep(0.5)
