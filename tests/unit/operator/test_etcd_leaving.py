"""Which nodes a scale-down marks leaving, and the one transaction that marks them, without
etcd. (The marks against a real etcd and real agents: tests/integration/recovery/
test_scale_down_marks.py.)"""

from __future__ import annotations

import base64
import socket

from elasticjob_operator.etcd import leaving
from elasticjob_operator.etcd.leaving import MemberKey, mark_txn, member_keys, to_mark
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.records import Member, encode_member

RUN = "uid-1"
MEMBERS = contract.members_prefix(RUN).encode()


def member(node: str, addr: str, lease: int) -> tuple[bytes, tuple[bytes, int]]:
    return MEMBERS + node.encode(), (encode_member(Member(addr=addr, pid=7)), lease)


def decoded(raw: str) -> str:
    return base64.b64decode(raw).decode()


def test_member_keys_are_read_with_their_address_and_lease() -> None:
    kvs = dict(
        [
            member("10.0.0.2_7_b", "10.0.0.2", 22),
            member("10.0.0.1_7_a", "10.0.0.1", 11),
            (MEMBERS + b"no-lease", (encode_member(Member("10.0.0.3", 7)), 0)),
            (MEMBERS + b"garbled", (b"not json", 33)),
            (b"/elasticjob/other/rdzv/members/x", (encode_member(Member("10.0.0.1", 7)), 44)),
        ]
    )
    assert member_keys(RUN, kvs) == [
        MemberKey("10.0.0.1_7_a", "10.0.0.1", 11),
        MemberKey("10.0.0.2_7_b", "10.0.0.2", 22),
    ]


def test_the_nodes_marked_are_those_in_the_pods_removed_old_keys_included() -> None:
    read = [
        MemberKey("10.0.0.1_7_a", "10.0.0.1", 11),
        MemberKey("10.0.0.2_7_b", "10.0.0.2", 22),
        MemberKey("10.0.0.2_9_c", "10.0.0.2", 23),  # its agent restarted: the old key lingers
        MemberKey("10.0.0.3_7_d", "10.0.0.3", 33),
    ]
    assert [m.node for m in to_mark(read, {"10.0.0.2", "10.0.0.3"})] == [
        "10.0.0.2_7_b",
        "10.0.0.2_9_c",
        "10.0.0.3_7_d",
    ]
    assert to_mark(read, set()) == []
    assert to_mark(read, {"10.0.0.9"}) == []  # its agent has not registered (or has gone)


def test_one_transaction_puts_every_mark_on_its_nodes_lease_if_no_lease_changed() -> None:
    marks = [MemberKey("n2", "10.0.0.2", 22), MemberKey("n3", "10.0.0.3", 33)]
    txn = mark_txn(RUN, marks)
    assert [(decoded(c["key"]), c["target"], c["result"], c["lease"]) for c in txn["compare"]] == [
        (contract.members_prefix(RUN) + "n2", "LEASE", "EQUAL", "22"),
        (contract.members_prefix(RUN) + "n3", "LEASE", "EQUAL", "33"),
    ]
    puts = [op["request_put"] for op in txn["success"]]
    assert [(decoded(p["key"]), p["lease"]) for p in puts] == [
        (contract.leaving_prefix(RUN) + "n2", "22"),
        (contract.leaving_prefix(RUN) + "n3", "33"),
    ]
    assert "failure" not in txn  # a lease changed: nothing is written, the read is repeated


def test_an_etcd_that_cannot_be_reached_marks_nobody() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert leaving.mark_leaving(f"127.0.0.1:{port}", RUN, {"10.0.0.1"}, timeout=2) == []
    assert leaving.mark_leaving("not an endpoint:x", RUN, {"10.0.0.1"}) == []
