"""Progress in a real etcd: what the operator reads, and that it goes away with the job."""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import EtcdServer, free_port, read_progress

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.progress import (
    ProgressReporter,
    SampleRate,
    published_ledger,
    reporter_from_env,
)
from elasticjob_runtime.etcd.records import Progress
from elasticjob_runtime.goodput import ledger as gl

pytestmark = pytest.mark.integration


@pytest.fixture
def client(etcd: EtcdServer) -> Iterator[EtcdClient]:
    c = EtcdClient(parse_endpoints(etcd.endpoint))
    yield c
    c.close()


def run_id() -> str:
    return f"progress-{uuid.uuid4().hex[:8]}"


def eventually(check: Callable[[], bool], bound: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < bound:
        if check():
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {bound} s")


def test_sample_rate_is_samples_over_the_window() -> None:
    rate = SampleRate(window=10)
    assert rate.add(100, now=0.0) == 0.0  # one point: no rate yet
    assert rate.add(100, now=1.0) == pytest.approx(100.0)
    assert rate.add(300, now=2.0) == pytest.approx(200.0)
    # a 28 s stall: the base is the newest point at least a window old, so the rate drops
    assert rate.add(0, now=30.0) == pytest.approx(0.0)
    assert rate.add(50, now=31.0) == pytest.approx(50 / 29)
    assert rate.add(500, now=41.0) == pytest.approx(50.0)  # only the last 10 s count: 500/10


def published(client: EtcdClient, rid: str, step: int, bound: float = 20) -> Progress:
    """The record once it shows ``step`` (the reporter publishes from its own thread)."""
    found: list[Progress] = []

    def check() -> bool:
        seen = read_progress(client, rid)
        found[:] = [seen] if seen is not None else []
        return seen is not None and seen.step == step

    eventually(check, bound)
    return found[0]


def test_operator_reads_step_rate_world_size_and_restarts(
    client: EtcdClient, etcd: EtcdServer
) -> None:
    rid = run_id()
    reporter = ProgressReporter(
        parse_endpoints(etcd.endpoint), rid, world_size=3, restart_count=2, min_interval=0
    )
    try:
        for step in range(1, 6):
            reporter.update(step, samples=96, epoch=1, checkpoint_step=step - 1)
            time.sleep(0.05)
        seen = published(client, rid, 5)
        assert (seen.step, seen.world_size, seen.restart_count, seen.epoch) == (5, 3, 2, 1)
        assert seen.checkpoint_step == 4
        assert 96 / 0.5 < seen.samples_per_second < 96 / 0.03
        assert abs(seen.updated - time.time()) < 30
        kv = client.get(contract.progress_key(rid))
        assert kv is not None and kv.lease != 0  # tied to a lease, so it cannot outlive the job
    finally:
        reporter.close()


def test_a_new_reporter_publishes_nothing_before_its_first_step_and_then_a_rate(
    client: EtcdClient, etcd: EtcdServer
) -> None:
    """After a regroup or a restart a new reporter takes over a running job's record: a
    placeholder (step 0) or a rate without a base (0 samples/s) reads as progress lost."""
    rid = run_id()
    reporter = ProgressReporter(parse_endpoints(etcd.endpoint), rid, world_size=2, min_interval=0)
    try:
        time.sleep(1.5)  # long enough for a publisher to have put a placeholder
        assert read_progress(client, rid) is None
        reporter.update(41, samples=64)
        seen = published(client, rid, 41)
        assert 0 < seen.samples_per_second < 64 / 1.5  # 64 samples since it was made
    finally:
        reporter.close()


def test_publishing_is_throttled(client: EtcdClient, etcd: EtcdServer) -> None:
    rid = run_id()
    reporter = ProgressReporter(parse_endpoints(etcd.endpoint), rid, world_size=1, min_interval=3)
    try:
        reporter.update(1, samples=8)
        published(client, rid, 1)
        reporter.update(2, samples=8)
        reporter.update(3, samples=8)
        time.sleep(1)  # well inside min_interval: nothing new is put
        seen = read_progress(client, rid)
        assert seen is not None and seen.step == 1
        published(client, rid, 3)  # the newest, once min_interval has passed
    finally:
        reporter.close()


def test_record_goes_away_on_close(client: EtcdClient, etcd: EtcdServer) -> None:
    rid = run_id()
    reporter = ProgressReporter(parse_endpoints(etcd.endpoint), rid, world_size=1, min_interval=0)
    reporter.update(1, samples=8)
    published(client, rid, 1)
    reporter.close()
    assert read_progress(client, rid) is None  # close() waited for the revoke


def test_the_ledger_goes_with_the_record_and_stays_under_its_own_key_after_close(
    client: EtcdClient, etcd: EtcdServer
) -> None:
    """The progress record goes with its lease; the goodput ledger must outlive it for a
    group that restarts later, and the newest one is what is read back."""
    rid = run_id()
    reporter = ProgressReporter(parse_endpoints(etcd.endpoint), rid, world_size=1, min_interval=0)
    book = gl.committed(gl.opened(100.0), 1, 105.0)
    reporter.update(1, samples=8, ledger=book)
    seen = published(client, rid, 1)
    assert seen.ledger == gl.encode(book)  # with the record, encoded in the background
    later = gl.committed(book, 2, 106.0)
    reporter.update(2, samples=8, ledger=later)
    published(client, rid, 2)
    # the ledger key was put with the first record; the record's (later) one is newer
    assert published_ledger(client, rid) == gl.encode(later)
    ended = gl.finished(later, 107.0)
    reporter.update_ledger(gl.interrupted(ended, "departure", 106.5))
    reporter.close()
    assert read_progress(client, rid) is None
    kept = client.get(contract.ledger_key(rid))
    assert kept is not None and kept.lease != 0  # on a lease of its own (an hour)
    doc = published_ledger(client, rid)
    assert doc is not None and gl.decode(doc).recoveries == {"departure": 1}  # the newest


def test_lease_is_kept_alive_while_the_reporter_lives(client: EtcdClient, etcd: EtcdServer) -> None:
    rid = run_id()
    reporter = ProgressReporter(
        parse_endpoints(etcd.endpoint), rid, world_size=1, ttl=2, min_interval=0
    )
    try:
        reporter.update(1, samples=8)
        published(client, rid, 1)
        time.sleep(5)  # more than twice the ttl with no update
        assert read_progress(client, rid) is not None
    finally:
        reporter.close()


def publisher(endpoint: str, rid: str) -> None:
    """Subprocess body: publish progress with a short lease, then wait to be killed."""
    reporter = ProgressReporter(parse_endpoints(endpoint), rid, world_size=2, ttl=2, min_interval=0)
    reporter.update(7, samples=16)
    print("updated", flush=True)
    time.sleep(3600)


def test_record_expires_when_the_publishing_process_dies(
    client: EtcdClient, etcd: EtcdServer
) -> None:
    rid = run_id()
    proc = subprocess.Popen(
        [sys.executable, __file__, etcd.endpoint, rid],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "updated"
        published(client, rid, 7)
        os.killpg(proc.pid, signal.SIGKILL)  # no close(): the lease must do it
        proc.wait(timeout=30)
        gone_after = eventually(lambda: read_progress(client, rid) is None, bound=20)
        print(f"progress key gone {gone_after:.1f} s after SIGKILL (ttl 2 s)")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_reporter_from_env_only_on_rank_zero_and_when_enabled(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch, client: EtcdClient
) -> None:
    rid = run_id()
    monkeypatch.setenv(contract.RDZV_BACKEND, "etcd-v3")
    monkeypatch.setenv(contract.RDZV_ENDPOINT, etcd.endpoint)
    monkeypatch.delenv(contract.PROGRESS_ENDPOINT, raising=False)
    monkeypatch.setenv(contract.RDZV_ID, rid)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("RANK", "1")
    assert reporter_from_env() is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(contract.PROGRESS, "0")
    assert reporter_from_env() is None
    monkeypatch.setenv(contract.PROGRESS, "1")
    reporter = reporter_from_env(min_interval=0)
    assert reporter is not None
    try:
        reporter.update(3, samples=64)
        seen = published(client, rid, 3)
        assert (seen.world_size, seen.restart_count) == (4, 1)
    finally:
        reporter.close()


def test_unreachable_etcd_is_one_line_from_the_background_and_costs_the_loop_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(contract.PROGRESS_ENDPOINT, f"127.0.0.1:{free_port()}")
    monkeypatch.setenv(contract.RDZV_ID, run_id())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(contract.PROGRESS, raising=False)
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.etcd.progress"):
        started = time.monotonic()
        reporter = reporter_from_env(min_interval=0)
        assert reporter is not None
        for step in range(1, 51):
            reporter.update(step, samples=8)
        assert time.monotonic() - started < 2.0  # nothing waited for etcd
        eventually(lambda: bool(caplog.records), bound=20)
        time.sleep(2.5)  # the publisher retries every second: still one line
        reporter.close(wait=10)
    [record] = caplog.records
    assert record.getMessage().startswith(
        "progress not published (retrying in the background): etcd at 127.0.0.1:"
    )


def test_a_reporter_sends_nothing_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A script forks its loader's workers right after Run(): a gRPC call in flight
    then can abort the forked child, so the publisher makes none before the first step.
    Seen from an etcd that is not there: its first request logs the one warning."""
    monkeypatch.setenv(contract.PROGRESS_ENDPOINT, f"127.0.0.1:{free_port()}")
    monkeypatch.setenv(contract.RDZV_ID, run_id())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(contract.PROGRESS, raising=False)
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.etcd.progress"):
        reporter = reporter_from_env(min_interval=0)
        assert reporter is not None
        try:
            time.sleep(2.0)  # a request would have failed at once (connection refused)
            assert caplog.records == []
            reporter.update(1, samples=8)
            eventually(lambda: bool(caplog.records), bound=20)
        finally:
            reporter.close(wait=10)
    assert caplog.records[0].getMessage().startswith("progress not published")


def test_a_fork_waits_for_the_publishers_call_in_flight() -> None:
    """A fork while the publisher opens its connection and grants its lease lost a
    DataLoader worker (etcd/fork_gate.py): the fork now waits for that call. The call is
    held open by a listener that accepts and never answers, so it lasts its timeout
    (3 s at ttl 9: room for a slow wake-up after the accept on a loaded machine); a fork
    made inside it returns only after it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    reporter = ProgressReporter(
        parse_endpoints(f"127.0.0.1:{silent.getsockname()[1]}"),
        run_id(),
        world_size=1,
        ttl=9,
        min_interval=0,
    )
    try:
        reporter.update(1, samples=8)
        readable, _, _ = select.select([silent], [], [], 20)
        assert readable, "the publisher never connected"
        conn, _ = silent.accept()  # the grant is in flight, and will get no answer
        with conn:
            started = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            waited = time.monotonic() - started
            assert os.waitpid(pid, 0)[1] == 0
        assert 0.3 < waited < 10, f"the fork waited {waited:.2f} s"
    finally:
        reporter.close(wait=10)
        silent.close()


def test_progress_returns_after_an_etcd_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from conftest import start_etcd

    server = start_etcd("3.5", tmp_path / "etcd")
    client = EtcdClient(parse_endpoints(server.endpoint), timeout=5)
    rid = run_id()
    reporter = ProgressReporter(
        parse_endpoints(server.endpoint), rid, world_size=1, ttl=3, min_interval=0
    )
    try:
        reporter.update(1, samples=8)
        published(client, rid, 1)
        with caplog.at_level(logging.INFO, logger="elasticjob_runtime.etcd.progress"):
            server.stop()
            reporter.update(2, samples=8)  # while etcd is away: returns at once
            time.sleep(4)  # longer than the lease ttl
            server.restart()
            reporter.update(3, samples=8)
            published(client, rid, 3, bound=30)
        messages = [r.getMessage() for r in caplog.records]
        assert "progress publishing works again" in messages
    finally:
        reporter.close()
        client.close()
        server.stop()


if __name__ == "__main__":
    publisher(sys.argv[1], sys.argv[2])
