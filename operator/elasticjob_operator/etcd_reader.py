"""Read what a run publishes in its etcd: the progress record, the node-memory reports,
the hang records.

The operator's only etcd I/O: the raw bytes, decoded by :mod:`elasticjob_operator.observe`.
Every member of the endpoint list is tried (the rendezvous fails over between them too).
An unreachable store reads as nothing: progress is a nicety and must not stop reconciling.
The job's etcd speaks mutual TLS: the caller passes the client certificate
(:meth:`elasticjob_operator.etcd_secrets.EtcdSecrets.client_credentials`), held in
memory only and never logged.

Three range reads per job and resync need no grpc: they go to etcd's JSON gateway
(``POST /v3/kv/range``, served on the client port) with the standard library, which
keeps grpc and protobuf out of the operator (16 MiB of its memory, measured).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import logging
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

from elasticjob_runtime import contract
from elasticjob_runtime.etcd_endpoints import Endpoint, TLSCredentials, parse_endpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecords:
    progress: bytes | None = None  # the progress record, if there is one
    memory_fallbacks: tuple[bytes, ...] = ()  # one per pod whose node-memory copy failed
    hangs: tuple[bytes, ...] = ()  # one per round in which the agents detected a hang


def read_run_records(
    endpoint: str,
    run_id: str,
    memory_fallbacks: bool = True,
    timeout: float = 1.0,
    tls: TLSCredentials | None = None,
) -> RunRecords:
    """The records of run ``run_id`` in the etcd at ``endpoint`` (``host:port[,...]``),
    over TLS with ``tls``; ``memory_fallbacks=False`` skips the reports (once said, they
    need no reading)."""
    # Any error reads as nothing, logged at debug: a store that is down or still starting
    # must not fail the round that replaces the job's workers.
    try:
        members = parse_endpoints(endpoint)
        context = _ssl_context(tls) if tls is not None else None
    except Exception as exc:
        log.debug("no progress from %r: %s", endpoint, exc)
        return RunRecords()
    error: Exception | None = None
    for member in members:  # the first that answers
        gateway = _Gateway(member, context, timeout)
        try:
            return _read(gateway, run_id, memory_fallbacks)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            error = exc
        finally:
            gateway.close()
    log.debug("no progress from %s: %s", endpoint, error)
    return RunRecords()


class _Gateway:
    """Range reads from one etcd member over its JSON gateway, on one connection."""

    def __init__(self, member: Endpoint, context: ssl.SSLContext | None, timeout: float) -> None:
        self.member = member
        self.conn: http.client.HTTPConnection = (
            http.client.HTTPSConnection(member.host, member.port, timeout=timeout, context=context)
            if context is not None
            else http.client.HTTPConnection(member.host, member.port, timeout=timeout)
        )

    def range(self, key: str, prefix: bool = False) -> dict[str, bytes]:
        body: dict[str, str] = {"key": _b64(key.encode())}
        if prefix:
            body["range_end"] = _b64(_prefix_end(key.encode()))
        self.conn.request(
            "POST", "/v3/kv/range", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise ValueError(f"{self.member}: HTTP {resp.status}: {data[:200]!r}")
        kvs = json.loads(data).get("kvs") or []
        return {
            base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in kvs
        }

    def close(self) -> None:
        self.conn.close()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


@functools.lru_cache(maxsize=256)
def _ssl_context(tls: TLSCredentials) -> ssl.SSLContext:
    """One context per set of credentials (a job's never change while it runs), not one
    per read: every job is read every resync. A rotated Secret is new credentials."""
    context = ssl.create_default_context(cadata=tls.ca.decode() if tls.ca else None)
    if tls.cert is not None and tls.key is not None:
        with _in_memory_file(tls.cert) as cert, _in_memory_file(tls.key) as key:
            context.load_cert_chain(cert, key)
    return context


@contextlib.contextmanager
def _in_memory_file(data: bytes) -> Iterator[str]:
    """A path to ``data`` that never touches a disk (ssl loads a key only from a path)."""
    fd = os.memfd_create("etcd-credential", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _read(gateway: _Gateway, run_id: str, memory_fallbacks: bool) -> RunRecords:
    progress = gateway.range(contract.progress_key(run_id)).get(contract.progress_key(run_id))
    prefix = contract.memory_fallback_prefix(run_id)
    reports = gateway.range(prefix, prefix=True) if memory_fallbacks else {}
    hangs = gateway.range(contract.hang_prefix(run_id), prefix=True)
    return RunRecords(
        progress=progress,
        memory_fallbacks=tuple(reports[k] for k in sorted(reports)),
        hangs=tuple(hangs[k] for k in sorted(hangs)),
    )
