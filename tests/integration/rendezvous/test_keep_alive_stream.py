"""Lease refreshes over one keep-alive stream, on a real etcd: a lease outlives many TTLs
on one stream, an expired lease reads as such, and an etcd restart costs a refresh or
two, not the lease keeper."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import EtcdServer, start_etcd

from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.endpoints import parse_endpoints

pytestmark = pytest.mark.integration


def streams() -> set[threading.Thread]:
    """The stream readers alive now: an earlier test's client may still be closing its
    own, so a test compares sets of threads, not counts."""
    return {t for t in threading.enumerate() if t.name == "etcd-keep-alive-stream"}


def test_a_lease_outlives_many_ttls_on_one_stream_and_a_revoked_one_reads_expired(
    etcd: EtcdServer,
) -> None:
    client = EtcdClient(parse_endpoints(etcd.endpoint), timeout=0.5)
    before = streams()
    try:
        lease = client.grant(1)
        client.put("ka-stream/held", b"x", lease)
        for _ in range(20):  # 4 s: four TTLs
            assert client.refresh(lease)
            time.sleep(0.2)
        assert client.get("ka-stream/held") is not None
        # one stream carried them all (the library opened a stream and two threads each)
        assert len(streams() - before) == 1
        client.revoke(lease)
        assert not client.refresh(lease)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while streams() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not streams() - before, "closing the client left its stream's reader behind"


def test_after_an_etcd_restart_the_next_refreshes_work_again(tmp_path: Path) -> None:
    server = start_etcd("3.6", tmp_path / "etcd")
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=0.5, reconnect_within=0.2)
    try:
        lease = client.grant(10)
        assert client.refresh(lease)
        server.restart()  # the stream's connection is gone; the lease is in etcd's data
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.refresh(lease):
                    break
            except EtcdError:
                pass  # the refresh that found the stream broken
            assert time.monotonic() < deadline, "no refresh worked after the restart"
            time.sleep(0.2)
        assert client.refresh(lease)  # and on the new stream
    finally:
        client.close()
        server.stop()


def test_closing_the_client_ends_a_refresh_that_waits_on_a_frozen_etcd(tmp_path: Path) -> None:
    """A lease keeper replaced while its refresh waits must not hold the replacement for
    the refresh's timeout."""
    server = start_etcd("3.6", tmp_path / "etcd")
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=30)
    failed: list[BaseException] = []

    def refresh() -> None:
        try:
            client.refresh(lease)
        except BaseException as exc:  # the test looks at it
            failed.append(exc)

    try:
        lease = client.grant(60)
        assert client.refresh(lease)
        os.kill(server.proc.pid, signal.SIGSTOP)
        waiting = threading.Thread(target=refresh)
        waiting.start()
        time.sleep(0.5)
        closed_at = time.monotonic()
        client.close()
        waiting.join(timeout=20)
        assert not waiting.is_alive(), "the refresh went on waiting after the close"
        assert time.monotonic() - closed_at < 10  # generous: not the 30 s timeout
        assert failed and isinstance(failed[0], EtcdError), failed
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        client.close()
        server.stop()
