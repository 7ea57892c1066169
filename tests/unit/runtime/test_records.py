"""The progress record, the node-memory report and the member record: one format, written
and read by the same code (the runtime publishes, the operator reads)."""

from __future__ import annotations

import json

import pytest

from elasticjob_runtime.etcd.records import (
    Member,
    MemoryFallback,
    Progress,
    decode_member,
    decode_memory_fallback,
    decode_progress,
    encode_member,
    encode_memory_fallback,
    encode_progress,
)


def test_progress_round_trips_and_ignores_fields_it_does_not_know() -> None:
    record = Progress(
        step=7, samples_per_second=12.5, world_size=3, restart_count=1, updated=1.5, epoch=2
    )
    assert decode_progress(encode_progress(record)) == record
    newer = dict(json.loads(encode_progress(record)), from_a_newer_runtime=True)
    assert decode_progress(json.dumps(newer).encode()) == record


def test_a_failed_save_travels_in_the_progress_record() -> None:
    record = Progress(
        step=9,
        samples_per_second=1.0,
        world_size=2,
        restart_count=0,
        updated=1.0,
        checkpoint_step=3,
        checkpoint_error="checkpoint step 9 not saved in /ckpt: ENOSPC (No space left on device)",
    )
    assert decode_progress(encode_progress(record)) == record
    wrong = {**json.loads(encode_progress(record)), "checkpoint_error": 5}
    with pytest.raises(ValueError, match="'checkpoint_error' must be a string"):
        decode_progress(json.dumps(wrong).encode())


def test_memory_fallback_round_trips() -> None:
    report = MemoryFallback("w-0", 20, 3 << 20, 1 << 20, 0, True, "no space", 9.0)
    assert decode_memory_fallback(encode_memory_fallback(report)) == report


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"samples_per_second": 1, "world_size": 1, "restart_count": 0, "updated": 1}', "step"),
        (b'{"step": "7", "samples_per_second": 1, "world_size": 1, "restart_count": 0}', "step"),
        (b'{"step": true, "samples_per_second": 1, "world_size": 1, "restart_count": 0}', "step"),
        (b'{"step": Infinity, "samples_per_second": 1, "world_size": 1}', "step"),
        (b'{"step": 1, "samples_per_second": NaN, "world_size": 1, "restart_count": 0}', "samples"),
    ],
)
def test_a_record_that_is_not_one_is_refused_naming_what_is_wrong(raw: bytes, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        decode_progress(raw)


def test_a_report_without_a_pod_is_refused() -> None:
    with pytest.raises(ValueError, match="pod"):
        decode_memory_fallback(b'{"step": 1, "checkpoint_bytes": 5}')


def test_a_member_record_names_the_address_the_operator_finds_a_pods_node_by() -> None:
    member = Member(addr="10.244.1.7", pid=42)
    assert decode_member(encode_member(member)) == member
    # what every agent before the record had a name wrote: the same document
    assert decode_member(b'{"addr": "10.244.1.7", "pid": 42}') == member
    with pytest.raises(ValueError, match="addr"):
        decode_member(b'{"pid": 42}')
    with pytest.raises(ValueError, match="pid"):
        decode_member(b'{"addr": "10.244.1.7"}')
    # an agent with a liveness port publishes it; a record without one has None
    with_port = Member(addr="10.244.1.7", pid=42, port=40123)
    assert decode_member(encode_member(with_port)) == with_port
    assert member.port is None
    # and its lease's granted TTL, how long the peer watching it waits (peer_watch.py)
    with_ttl = Member(addr="10.244.1.7", pid=42, port=40123, ttl=2)
    assert decode_member(encode_member(with_ttl)) == with_ttl
    assert member.ttl is None
    with pytest.raises(ValueError, match="ttl"):
        decode_member(b'{"addr": "10.244.1.7", "pid": 42, "ttl": "2"}')
