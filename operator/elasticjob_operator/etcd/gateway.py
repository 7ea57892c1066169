"""One connection to an etcd member's JSON gateway (``POST /v3/...`` on the client port).

The operator's every etcd call goes through here, with the standard library: that keeps
grpc and protobuf out of the operator (16 MiB of its memory, measured). TLS credentials
are held in memory only and never logged; an auth token, when the etcd has
authentication on (:mod:`elasticjob_operator.etcd.shared`), rides in the
``Authorization`` header as etcd's gateway wants it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import os
import ssl
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from elasticjob_operator.etcd.shared import prefix_end
from elasticjob_runtime.etcd.endpoints import Endpoint, TLSCredentials

# what the gateway answers for a token it does not know (expired: etcd forgets a simple
# token five minutes after its last use, and all of them when it restarts)
INVALID_TOKEN = "invalid auth token"


class GatewayError(ValueError):
    """etcd answered with an error: the HTTP status and etcd's own message."""

    def __init__(self, member: Endpoint, status: int, message: str) -> None:
        super().__init__(f"etcd at {member}: HTTP {status}: {message}")
        self.status = status
        self.message = message


T = TypeVar("T")


class NoMemberAnswered(Exception):
    """No member of an etcd cluster answered (:func:`on_first_member`): the last error."""


class Gateway:
    """Calls to one etcd member over its JSON gateway, on one connection."""

    def __init__(
        self,
        member: Endpoint,
        tls: TLSCredentials | None,
        timeout: float,
        token: str | None = None,
    ) -> None:
        self.member = member
        self.token = token
        self.conn: http.client.HTTPConnection = (
            http.client.HTTPSConnection(
                member.host, member.port, timeout=timeout, context=ssl_context(tls)
            )
            if tls is not None
            else http.client.HTTPConnection(member.host, member.port, timeout=timeout)
        )

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST path`` with ``body``; etcd's JSON answer, GatewayError for an error."""
        headers = {"Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = self.token
        self.conn.request("POST", path, json.dumps(body), headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            try:
                message = str(json.loads(data).get("message") or data[:200])
            except (ValueError, AttributeError):
                message = repr(data[:200])
            raise GatewayError(self.member, resp.status, message)
        answer: dict[str, Any] = json.loads(data)
        return answer

    def range(self, key: bytes, prefix: bool = False) -> dict[bytes, bytes]:
        """The keys ``key`` (or, with ``prefix``, every key starting with it) and values."""
        body = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_end(key))
        kvs = self.call("/v3/kv/range", body).get("kvs") or []
        return {base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", "")) for kv in kvs}

    def leased(self, prefix: bytes) -> dict[bytes, tuple[bytes, int]]:
        """Every key starting with ``prefix``, with its value and the lease it is on (0:
        none): etcd's int64s come as JSON strings, and a zero is left out."""
        body = {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}
        kvs = self.call("/v3/kv/range", body).get("kvs") or []
        return {
            base64.b64decode(kv["key"]): (
                base64.b64decode(kv.get("value", "")),
                int(kv.get("lease") or 0),
            )
            for kv in kvs
        }

    def txn(self, body: dict[str, Any]) -> bool:
        """One transaction (``compare``, ``success``, ``failure`` as etcd's JSON has them);
        whether its comparisons held (etcd leaves a false ``succeeded`` out)."""
        return bool(self.call("/v3/kv/txn", body).get("succeeded"))

    def close(self) -> None:
        self.conn.close()


def on_first_member(
    members: Sequence[Endpoint],
    tls: TLSCredentials | None,
    timeout: float,
    token: str | None,
    use: Callable[[Gateway], T],
) -> T:
    """``use`` a gateway to the first member that answers, closed after; a member whose
    gateway fails (a connection, HTTP or etcd error, credentials ssl cannot load) passes
    to the next. :class:`NoMemberAnswered` with the last error when none did."""
    error: Exception = NoMemberAnswered("no etcd member given")
    for member in members:
        try:
            gateway = Gateway(member, tls, timeout, token)
        except (OSError, ValueError) as exc:
            error = exc
            continue
        try:
            return use(gateway)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            error = exc
        finally:
            gateway.close()
    raise NoMemberAnswered(str(error)) from error


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@functools.lru_cache(maxsize=256)
def ssl_context(tls: TLSCredentials) -> ssl.SSLContext:
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
