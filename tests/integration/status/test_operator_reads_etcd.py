"""The operator reads a run's records from a real etcd: every member of the endpoint list
is tried, a store that is down reads as nothing, a malformed record is no progress."""

from __future__ import annotations

import time
import uuid

import pytest
from conftest import EtcdServer, free_port

from elasticjob_operator import observe
from elasticjob_operator.etcd.reader import RunRecords, read_run_records
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.records import (
    Hang,
    MemoryFallback,
    Progress,
    encode_hang,
    encode_memory_fallback,
    encode_progress,
)

pytestmark = pytest.mark.integration


def put(etcd: EtcdServer, items: dict[str, bytes]) -> None:
    client = EtcdClient(parse_endpoints(etcd.endpoint))
    try:
        for key, value in items.items():
            client.put(key, value)
    finally:
        client.close()


def report(pod: str, step: int) -> MemoryFallback:
    return MemoryFallback(pod, step, 300 << 20, 64 << 20, 60 << 20, True, "", time.time())


def test_records_are_read_from_any_member_of_the_endpoint_list(etcd: EtcdServer) -> None:
    run = f"uid-{uuid.uuid4().hex[:8]}"
    progress = Progress(
        step=42, samples_per_second=10.0, world_size=2, restart_count=0, updated=time.time()
    )
    reports = [report("train-worker-1", 7), report("train-worker-0", 5)]
    put(
        etcd,
        {
            contract.progress_key(run): encode_progress(progress),
            **{
                contract.memory_fallback_key(run, r.pod): encode_memory_fallback(r) for r in reports
            },
        },
    )
    down = f"127.0.0.1:{free_port()}"  # a member that does not answer, listed first
    seen = read_run_records(f"{down},{etcd.endpoint}", run, timeout=2.0)
    status = observe.progress_of(seen.progress)
    assert status is not None and (status.step, status.world_size) == (42, 2)
    assert observe.memory_fallbacks_of(seen.memory_fallbacks) == tuple(reversed(reports))
    # once said, the reports are not read again
    assert read_run_records(etcd.endpoint, run, memory_fallbacks=False).memory_fallbacks == ()


def test_a_store_that_is_down_reads_as_nothing() -> None:
    started = time.monotonic()
    assert read_run_records(f"127.0.0.1:{free_port()}", "uid-x", timeout=0.5) == RunRecords()
    assert read_run_records("", "uid-x") == RunRecords()  # not an endpoint at all
    assert time.monotonic() - started < 60  # bounded: a resync must not hang on it


def test_a_malformed_record_is_no_progress_and_a_bad_report_is_skipped(
    etcd: EtcdServer,
) -> None:
    run = f"uid-{uuid.uuid4().hex[:8]}"
    good = report("train-worker-0", 3)
    put(
        etcd,
        {
            contract.progress_key(run): b'{"step": "forty-two"}',
            contract.memory_fallback_key(run, "train-worker-0"): encode_memory_fallback(good),
            contract.memory_fallback_key(run, "train-worker-1"): b"{not json",
        },
    )
    seen = read_run_records(etcd.endpoint, run)
    assert seen.progress == b'{"step": "forty-two"}'
    assert observe.progress_of(seen.progress) is None
    assert observe.memory_fallbacks_of(seen.memory_fallbacks) == (good,)


def test_hang_records_are_read_in_round_order_and_a_bad_one_is_skipped(etcd: EtcdServer) -> None:
    run = f"uid-{uuid.uuid4().hex[:8]}"
    hangs = [Hang(r, "train-worker-0", 10 * r, 31.0, 30.0, time.time()) for r in (12, 3)]
    put(
        etcd,
        {
            **{contract.hang_key(run, h.round): encode_hang(h) for h in hangs},
            contract.hang_key(run, 7): b'{"round": "seven"}',
        },
    )
    seen = read_run_records(etcd.endpoint, run, memory_fallbacks=False)
    assert observe.hangs_of(seen.hangs) == (hangs[1], hangs[0])
