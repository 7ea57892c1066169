"""Mark every node a scale-down removes as leaving, in the run's etcd, in one transaction.

A node told to stop (its pod's SIGTERM) announces its own departure: it puts its leaving
key (``rdzv/leaving/<node>``), and the others regroup without it at a step boundary. But
kubelets signal the pods of one scale-down one after the other, so removing k pods cost k
regroups (on kind, worlds 4, 3, 2 for a scale from 4 to 2). The operator knows every pod
it removes: it puts all their nodes' leaving keys in one transaction before it deletes
them, so the others' watch sees them in one event and they regroup once. A node that sees
its own mark departs as a SIGTERMed one does (the runtime's ``launch/departing.py``).

A pod's node is the member key whose record holds the pod's IP: an agent in a pod
rendezvouses from it (``--local-addr`` defaults to ``ELASTICJOB_POD_IP``). Each mark is
put on that node's member lease, so it goes with the node, and the transaction compares
every member key's lease: a mark never lands on a lease the node has replaced (the read
is repeated then). Best effort, like the reader: a run whose etcd cannot be written is
left to its SIGTERMs, one regroup each, as before.

The decisions (:func:`member_keys`, :func:`to_mark`, :func:`mark_txn`) are pure; the
I/O (:func:`mark_leaving`) goes through the JSON gateway, as the operator's other etcd
calls do.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from elasticjob_operator.etcd.gateway import (
    Gateway,
    GatewayError,
    NoMemberAnswered,
    b64,
    on_first_member,
)
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.endpoints import TLSCredentials, parse_endpoints
from elasticjob_runtime.etcd.records import decode_member

log = logging.getLogger(__name__)

# Reads and transactions per etcd member before giving up: a member key whose lease
# changed between them (the node took a new one) makes the transaction fail, once.
ATTEMPTS: Final = 3


@dataclass(frozen=True)
class MemberKey:
    """One agent's member key as read: its node's name, address and member lease."""

    node: str
    addr: str
    lease: int


def member_keys(run_id: str, kvs: Mapping[bytes, tuple[bytes, int]]) -> list[MemberKey]:
    """The member keys of run ``run_id`` among ``kvs`` (key: value, lease), by node name.
    A key on no lease, or whose record is not one, is skipped: no mark could go with it."""
    prefix = contract.members_prefix(run_id).encode()
    found = []
    for key, (value, lease) in sorted(kvs.items()):
        if not key.startswith(prefix) or not lease:
            continue
        try:
            addr = decode_member(value).addr
        except ValueError:
            continue
        found.append(MemberKey(key[len(prefix) :].decode(errors="replace"), addr, lease))
    return found


def to_mark(members: Sequence[MemberKey], ips: Collection[str]) -> list[MemberKey]:
    """The nodes in the pods at ``ips``: every member key with one of those addresses (a
    pod whose agent restarted may still hold its old key for a lease TTL)."""
    return [m for m in members if m.addr in ips]


def mark_txn(run_id: str, marks: Sequence[MemberKey]) -> dict[str, Any]:
    """The one transaction: each node's leaving key on its member lease, if every one of
    those member keys is still on the lease read."""
    members, leaving = contract.members_prefix(run_id), contract.leaving_prefix(run_id)
    return {
        "compare": [
            {
                "key": b64((members + m.node).encode()),
                "target": "LEASE",
                "result": "EQUAL",
                "lease": str(m.lease),
            }
            for m in marks
        ],
        "success": [
            {
                "request_put": {
                    "key": b64((leaving + m.node).encode()),
                    "value": "",
                    "lease": str(m.lease),
                }
            }
            for m in marks
        ],
    }


def mark_leaving(
    endpoint: str,
    run_id: str,
    ips: Collection[str],
    tls: TLSCredentials | None = None,
    token: str | None = None,
    timeout: float = 1.0,
) -> list[str]:
    """Mark the nodes in the pods at ``ips`` leaving in run ``run_id``'s etcd at
    ``endpoint`` (``host:port[,...]``), over TLS with ``tls``, as the user of ``token``
    if given. Returns the nodes marked; none when etcd could not be written (logged)."""
    try:
        members = parse_endpoints(endpoint)
    except ValueError as exc:
        log.info("run %s: no leaving marks: %s", run_id, exc)
        return []

    def mark(gateway: Gateway) -> list[str]:
        error: Exception | None = None
        for _ in range(ATTEMPTS):
            prefix = contract.members_prefix(run_id).encode()
            marks = to_mark(member_keys(run_id, gateway.leased(prefix)), ips)
            if not marks:
                return []  # no agent of those pods is in the run (yet, or any more)
            try:
                if gateway.txn(mark_txn(run_id, marks)):
                    return [m.node for m in marks]
            except GatewayError as exc:  # a lease that ran out as we wrote: read again
                error = exc
        raise error or ValueError("a member lease changed under every attempt")

    try:
        return on_first_member(members, tls, timeout, token, mark)
    except NoMemberAnswered as exc:
        log.info("run %s: could not mark the leaving nodes in %s: %s", run_id, endpoint, exc)
        return []
