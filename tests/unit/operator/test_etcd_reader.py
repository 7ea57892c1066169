"""The operator's etcd reader without grpc: range ends, and nothing from a dead endpoint.
(Reads from a real etcd, with and without TLS, are in tests/integration.)"""

from __future__ import annotations

import socket

from elasticjob_operator.etcd import reader as etcd_reader
from elasticjob_operator.etcd.shared import prefix_end


def test_a_prefix_range_ends_after_every_key_that_starts_with_it() -> None:
    end = prefix_end(b"/elasticjob/run/hangs/")
    assert end == b"/elasticjob/run/hangs0"
    assert b"/elasticjob/run/hangs/" < b"/elasticjob/run/hangs/\xff\xff" < end
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"  # every key


def test_an_endpoint_that_refuses_reads_as_nothing() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    records = etcd_reader.read_run_records(f"127.0.0.1:{port}", "run", timeout=2)
    assert records == etcd_reader.RunRecords()
