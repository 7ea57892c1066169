"""The one place that talks to etcd's v3 API.

Everything else in the runtime goes through :class:`EtcdClient`, so the client
library (``etcd-sdk-python``, imported as ``pyetcd``: python-etcd3's API, kept
working with current protobuf) can be swapped without touching the rendezvous.
Errors leave this module as :class:`EtcdError` with one readable line; a TLS handshake
that fails says which side refused and which setting to check (:class:`EtcdTLSError`).
Which TLS settings apply is decided in :mod:`elasticjob_runtime.etcd.tls`; endpoints and
credentials are plain data in :mod:`elasticjob_runtime.etcd.endpoints`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elasticjob_runtime.etcd.dns import GRPC_DNS_RESOLVER, grpc_dns_resolver

# Before gRPC starts: it reads the variable once. See etcd/dns.py.
os.environ[GRPC_DNS_RESOLVER] = grpc_dns_resolver(os.environ)

import grpc  # type: ignore[import-untyped]
import pyetcd.events
import pyetcd.exceptions
from pyetcd import etcdrpc
from pyetcd.client import Endpoint as _PyEndpoint
from pyetcd.client import MultiEndpointEtcd3Client

# where an etcd is and how to trust it, grpc-free (the operator reads etcd without grpc)
from elasticjob_runtime.etcd.endpoints import Endpoint, TLSCredentials
from elasticjob_runtime.etcd.keep_alive_stream import KeepAliveStream, StreamBroken

RECHECK_AFTER = 5.0


class EtcdError(RuntimeError):
    """An etcd request failed; the message names the endpoint and what to check."""


class EtcdTLSError(EtcdError):
    """The TLS handshake with etcd failed: a setting is wrong, waiting will not help."""


class EtcdLeaseNotFound(EtcdError):
    """A write named a lease etcd does not know (it expired, or a new etcd lost its data):
    every retry with that lease fails the same way; take a new one."""


LEASE_NOT_FOUND = "requested lease not found"  # etcd's own text (rpctypes.ErrLeaseNotFound)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class Lease:
    id: int
    ttl: int  # what etcd granted, which may be more than was asked for


@dataclass(frozen=True)
class Snapshot:
    """All keys under a prefix as of one store revision."""

    revision: int
    items: dict[str, KeyValue]


@dataclass(frozen=True)
class Change:
    """One key a watch saw change: put (``deleted`` False) or deleted."""

    key: str
    deleted: bool


def _text(key: bytes | str) -> str:
    return key.decode() if isinstance(key, bytes) else key


def _kv(raw: Any) -> KeyValue:
    return KeyValue(
        key=raw.key.decode(), value=bytes(raw.value), mod_revision=raw.mod_revision, lease=raw.lease
    )


def _describe(exc: BaseException) -> str:
    for e in (exc.__context__, exc.__cause__):  # the gRPC error pyetcd replaced
        if not isinstance(exc, grpc.RpcError) and isinstance(e, grpc.RpcError):
            exc = e
            break
    if isinstance(exc, grpc.RpcError):
        details = exc.details() if hasattr(exc, "details") else ""
        return f"{exc.code().name}: {details}" if hasattr(exc, "code") else str(exc)
    return str(exc) or type(exc).__name__


def _grpc_details(exc: BaseException) -> str:
    """The gRPC error's details, also where pyetcd replaced it by one of its own."""
    for e in (exc, exc.__context__, exc.__cause__):
        if isinstance(e, grpc.RpcError) and hasattr(e, "details"):
            return str(e.details() or "")
    return ""


def connection_hint(details: str, tls: TLSCredentials | None) -> str:
    """What to add when etcd closed or reset the connection: it may want TLS, or a client
    certificate, or refused ours; or it was restarting. So a hint, not a verdict (a TLS
    alert that a reset overtook on the way reads the same)."""
    if not any(s in details for s in ("Socket closed", "Connection reset", "connection reset")):
        return ""
    if tls is None:
        return (
            "; if etcd serves TLS, use an https:// endpoint and set ELASTICJOB_ETCD_CACERT, "
            "ELASTICJOB_ETCD_CERT and ELASTICJOB_ETCD_KEY (or --rdzv-conf "
            "cacert=...,cert=...,key=...)"
        )
    if tls.cert is None:
        return (
            "; etcd closed the TLS connection: if it asks for a client certificate (a job's "
            "own etcd does), set ELASTICJOB_ETCD_CERT and ELASTICJOB_ETCD_KEY (or "
            "--rdzv-conf cert=...,key=...)"
        )
    return (
        "; etcd closed the TLS connection: if it refused the client certificate, check that "
        f"{tls.cert_from} is signed by the CA etcd trusts (--trusted-ca-file)"
    )


def tls_problem(details: str, tls: TLSCredentials | None) -> str | None:
    """What a failed connection's gRPC ``details`` say about TLS, as what to fix; None
    when they say nothing about it (etcd down, a timeout)."""
    if tls is None:
        return None
    if "CERTIFICATE_VERIFY_FAILED" in details:
        trusted = tls.ca_from if tls.ca is not None else "the system's CA certificates"
        return (
            f"etcd's certificate is not signed by a CA in {trusted}; check that it is "
            "the CA that signed etcd's certificate"
        )
    if "not in peer certificate" in details or "Peer name" in details:
        return (
            "etcd's certificate is not valid for this host name; connect by a name in its "
            "subjectAltNames (for the job's own etcd: <job>-etcd.<namespace>.svc)"
        )
    if "WRONG_VERSION_NUMBER" in details or "wrong version number" in details:
        return "etcd does not serve TLS there; use an http:// endpoint without TLS settings"
    # TLS 1.3: the client may finish its handshake before etcd checks its certificate;
    # etcd's alert then arrives where data was expected ("Unwrap failed").
    refused = (
        "BAD_CERTIFICATE",
        "CERTIFICATE_REQUIRED",
        "UNKNOWN_CA",
        "HANDSHAKE_FAILURE",
        "Unwrap failed",
        "TSI_DATA_CORRUPTED",
    )
    if any(alert in details for alert in refused):
        if tls.cert is None:
            return (
                "etcd asks for a client certificate and none was given; set "
                "ELASTICJOB_ETCD_CERT and ELASTICJOB_ETCD_KEY (or --rdzv-conf cert=...,key=...)"
            )
        return (
            f"etcd refused the client certificate; check that {tls.cert_from} is signed by "
            "the CA etcd trusts (--trusted-ca-file): another job's certificate is refused"
        )
    # "tcp handshaker shutdown" is gRPC's TCP connect giving up (no SYN-ACK: an address
    # a NetworkPolicy does not admit yet, an etcd not up): waiting may help, so no verdict
    if "handshake" in details.lower().replace("tcp handshaker", ""):
        return f"the TLS handshake failed ({details}); check {tls.ca_from} and {tls.cert_from}"
    return None


class EtcdClient:
    """A thin, typed face over ``pyetcd`` with the few operations the runtime needs."""

    def __init__(
        self,
        endpoint: Endpoint | Sequence[Endpoint],
        timeout: float = 5.0,
        reconnect_within: float | None = None,
        tls: TLSCredentials | None = None,
    ) -> None:
        """``reconnect_within``: after a lost connection (an etcd restart), try again at
        least this often (seconds) instead of gRPC's backoff, which grows past a minute.
        ``tls``: connect over TLS (None: plain text); open clients with
        :func:`elasticjob_runtime.etcd.tls.connect`, which decides it."""
        endpoints = [endpoint] if isinstance(endpoint, Endpoint) else list(endpoint)
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoint = endpoints[0]
        self.endpoints = tuple(endpoints)
        self.where = ",".join(str(e) for e in endpoints)
        self.tls = tls
        self._timeout = timeout
        # pyetcd sets a failed endpoint aside for time_retry seconds (300 by default).
        # With one endpoint that would turn a brief etcd restart into a five-minute
        # outage, so retry it at once; with several, fail over for a few seconds.
        retry = 0.0 if len(endpoints) == 1 else 5.0
        # A connection of its own: gRPC otherwise shares one TCP connection among the
        # channels a process opens to the same address with the same options (its global
        # subchannel pool), so a lease keeper started anew because its connection was cut
        # off (lease_holder.py) would have gone on over that same dead connection.
        options = [("grpc.use_local_subchannel_pool", 1)]
        if reconnect_within is not None:
            backoff_ms = max(int(reconnect_within * 1000), 1)
            options += [
                ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 100)),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ]
        creds = None
        if tls is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
            )
        channels = [
            _PyEndpoint(
                e.host, e.port, secure=tls is not None, creds=creds, time_retry=retry, opts=options
            )
            for e in endpoints
        ]
        self._ready: Any = None  # grpc.channel_ready_future, once connected() has asked
        self._closed = False
        self._pyetcd: Any = MultiEndpointEtcd3Client(
            endpoints=channels, timeout=timeout, failover=len(endpoints) > 1
        )
        self._keep_alive = KeepAliveStream(
            self._open_keep_alive, lambda lease: etcdrpc.LeaseKeepAliveRequest(ID=lease)
        )

    @property
    def _client(self) -> Any:
        """The pyetcd client, while this one is open: a request on a closed gRPC channel
        can crash the process (a segfault in grpc's stub set-up), and a lease keeper
        replaced while stuck in a call may make one when its call returns."""
        if self._closed:
            raise EtcdError(f"the connection to etcd at {self.where} is closed")
        return self._pyetcd

    @property
    def timeout(self) -> float:
        """Each request's timeout, seconds; settable (the next request uses the new one)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = value
        self._pyetcd.timeout = value

    def another(self, timeout: float, reconnect_within: float | None = None) -> EtcdClient:
        """A second connection (its own TCP connection) to the same etcd with the same TLS
        settings."""
        return EtcdClient(self.endpoints, timeout, reconnect_within, self.tls)

    def connect(self, within: float) -> None:
        """Open the connection now, TLS handshake included, giving it ``within`` seconds:
        otherwise the first request pays for it out of its own timeout, which a client for
        lease refreshes keeps far shorter than a handshake may take on a busy cluster."""
        try:
            self._ready_future().result(timeout=within)
        except grpc.FutureTimeoutError as exc:
            raise EtcdError(
                f"cannot reach etcd at {self.where}: no connection within {within:g} s"
            ) from exc

    def connected(self) -> bool:
        """Is the connection open now (TLS handshake done)? Asks without waiting; the first
        call starts opening it. Once open it stays "connected" here even if it breaks
        later: a request over it then fails, and callers fall back (the lease keeper)."""
        if self._closed:
            return False
        ready = self._ready_future()
        return bool(ready.done() and not ready.cancelled())

    def _ready_future(self) -> Any:
        """One ``grpc.channel_ready_future`` per client, cancelled by :meth:`close`: until
        then a thread of gRPC's polls the channel, and one left polling a closed channel
        raises in that thread."""
        if self._ready is None:
            self._ready = grpc.channel_ready_future(self._client.channel)
        return self._ready

    def _tls_error(self, exc: BaseException) -> EtcdTLSError | None:
        problem = tls_problem(_grpc_details(exc), self.tls)
        if problem is None:
            return None
        return EtcdTLSError(f"cannot connect to etcd at {self.where} over TLS: {problem}")

    def _fail(self, what: str, exc: BaseException) -> EtcdError:
        tls_error = self._tls_error(exc)
        if tls_error is not None:
            return tls_error
        details = _grpc_details(exc)
        message = f"etcd at {self.where}: {what} failed ({_describe(exc)})"
        if LEASE_NOT_FOUND in details:
            return EtcdLeaseNotFound(message)
        return EtcdError(message + connection_hint(details, self.tls))

    def check(self) -> str:
        """Return the server version; raise a one-line error if etcd is unreachable."""
        try:
            return str(self._client.status().version)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            tls_error = self._tls_error(exc)
            if tls_error is not None:
                raise tls_error from exc
            hint = connection_hint(_grpc_details(exc), self.tls)
            raise EtcdError(
                f"cannot reach etcd at {self.where} ({_describe(exc)}); start etcd there "
                f"or point --rdzv-endpoint / PET_RDZV_ENDPOINT at a running etcd{hint}"
            ) from exc

    def get(self, key: str) -> KeyValue | None:
        try:
            resp = self._client.get_response(key)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"get {key}", exc) from exc
        return _kv(resp.kvs[0]) if resp.kvs else None

    def snapshot(self, prefix: str) -> Snapshot:
        try:
            resp = self._client.get_prefix_response(prefix)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"read {prefix}", exc) from exc
        kvs = [_kv(kv) for kv in resp.kvs]
        return Snapshot(revision=resp.header.revision, items={kv.key: kv for kv in kvs})

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        try:
            self._client.put(key, value, lease=lease)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"put {key}", exc) from exc

    def compare_and_set(
        self,
        key: str,
        value: bytes,
        mod_revision: int | None,
        lease: int | None = None,
        also: Mapping[str, bytes] | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` only if ``key`` is still at ``mod_revision`` (None: absent),
        and with it every key in ``also`` (under the same lease).

        One transaction: on success returns the key as written, on failure the
        key as it is now (None if it does not exist), so a loser never needs a
        second round trip.
        """
        t = self._client.transactions
        cond = t.create(key) == 0 if mod_revision is None else t.mod(key) == mod_revision
        puts = [t.put(k, v, lease) for k, v in (also or {}).items()]
        try:
            ok, responses = self._client.transaction(
                compare=[cond],
                success=[*puts, t.put(key, value, lease), t.get(key)],
                failure=[t.get(key)],
            )
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"compare-and-set {key}", exc) from exc
        current = responses[-1]
        if not current:
            return bool(ok), None
        _, meta = current[0]
        return bool(ok), KeyValue(
            key=key, value=bytes(current[0][0]), mod_revision=meta.mod_revision, lease=meta.lease_id
        )

    def delete(self, key: str) -> bool:
        try:
            return bool(self._client.delete(key))
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"delete {key}", exc) from exc

    def delete_prefix(self, prefix: str) -> None:
        try:
            self._client.delete_prefix(prefix)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"delete {prefix}*", exc) from exc

    def delete_range(self, start: str, end: str) -> None:
        """Delete every key in ``[start, end)``."""
        t = self._client.transactions
        try:
            self._client.transaction(
                compare=[], success=[t.delete(start, range_end=end)], failure=[]
            )
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"delete {start}..{end}", exc) from exc

    def grant(self, ttl: int) -> int:
        """Grant a lease; keys put with it vanish ``ttl`` seconds after the last refresh."""
        return self.grant_lease(ttl).id

    def grant_lease(self, ttl: int) -> Lease:
        """Grant a lease and say for how long: etcd raises a TTL below its minimum
        (``ceil(1.5 x --election-timeout)``) to that minimum without an error."""
        try:
            granted = self._client.lease(ttl)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail("lease grant", exc) from exc
        return Lease(id=int(granted.id), ttl=int(granted.ttl))

    def refresh(self, lease: int) -> bool:
        """Keep a lease alive; False if it has already expired.

        One message on this connection's keep-alive stream (keep_alive_stream.py says
        why); when the stream broke, one request of its own, so that an error reads as
        any other request's and pyetcd's endpoint failover sees it."""
        try:
            return self._keep_alive.refresh(lease, self._timeout) > 0
        except TimeoutError as exc:
            raise EtcdError(
                f"etcd at {self.where}: lease keep-alive failed (no answer within "
                f"{self._timeout:.2f} s)"
            ) from exc
        except StreamBroken:
            pass
        try:
            responses = list(self._client.refresh_lease(lease))
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail("lease keep-alive", exc) from exc
        return bool(responses) and responses[-1].TTL > 0

    def _open_keep_alive(self, requests: Iterator[Any]) -> Any:
        client = self._client
        return client.leasestub.LeaseKeepAlive(
            requests, credentials=client.call_credentials, metadata=client.metadata
        )

    def revoke(self, lease: int) -> None:
        try:
            self._client.revoke_lease(lease)
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail("lease revoke", exc) from exc

    def watch_prefix(
        self,
        prefix: str,
        start_revision: int,
        on_change: Callable[[], None],
        on_error: Callable[[], None] | None = None,
        on_keys: Callable[[list[Change]], None] | None = None,
    ) -> Callable[[], None]:
        """Call ``on_change`` on every change under ``prefix`` from ``start_revision``,
        after ``on_keys`` (if given) with the keys that changed.

        Errors (a lost stream, a compacted revision) end the watch: they call
        ``on_error`` and then ``on_change``, so callers re-read (and watch again)
        rather than miss a change. Returns a function that cancels the watch.
        """

        def callback(response: object) -> None:
            if response is None or isinstance(response, BaseException):
                if on_error:
                    on_error()
            elif on_keys is not None:
                on_keys(
                    [
                        Change(_text(e.key), isinstance(e, pyetcd.events.DeleteEvent))
                        for e in getattr(response, "events", ())
                    ]
                )
            on_change()

        try:
            watch_id = self._client.add_watch_prefix_callback(
                prefix, callback, start_revision=start_revision
            )
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"watch {prefix}", exc) from exc

        def cancel() -> None:
            with contextlib.suppress(
                pyetcd.exceptions.Etcd3Exception, grpc.RpcError, ValueError, EtcdError
            ):
                self._client.cancel_watch(watch_id)

        return cancel

    def wait_for_change(
        self, prefixes: str | Sequence[str], after_revision: int, timeout: float
    ) -> bool:
        """Block until something under any of ``prefixes`` changes after ``after_revision``.

        Returns after at most :data:`RECHECK_AFTER` seconds even if nothing did:
        every caller re-reads the state when this returns, so a watch event that
        never arrives (a stalled stream) costs a few seconds, not the whole timeout.

        A change written between the caller's read and the watch's creation, the usual
        order in a round that forms in milliseconds, makes etcd count the watch as
        *unsynced*: its first event then comes from etcd's catch-up loop, which runs
        every 100 ms (measured: a median of 99 ms per such wait, two or three waits per
        regroup). So once the watch stands, one read asks for a key under the prefixes
        put after ``after_revision``: there is one, and the wait returns at once. A
        delete in that gap (a lost member the leader waits for) still waits for the
        catch-up, since a read does not show it; so does a put that lands after this
        read while etcd still counts the watch as unsynced (a write elsewhere came
        between the caller's read and the watch).
        """
        names = [prefixes] if isinstance(prefixes, str) else list(prefixes)
        changed = threading.Event()
        cancels: list[Callable[[], None]] = []
        try:
            for prefix in names:
                cancels.append(self.watch_prefix(prefix, after_revision + 1, changed.set))
            if self._put_after(names, after_revision):
                return True
            return changed.wait(min(max(timeout, 0.0), RECHECK_AFTER))
        finally:
            for cancel in cancels:
                cancel()

    def _put_after(self, prefixes: Sequence[str], after_revision: int) -> bool:
        """Was a key under the common part of ``prefixes`` put after ``after_revision``?
        One read, of at most one key name (a key beside the prefixes that changed says
        yes too: the caller reads again and finds nothing new, which is harmless)."""
        common = os.path.commonprefix(list(prefixes))  # noqa: RUF071 (keys, not paths)
        if not common:
            return False
        try:
            resp = self._client.get_prefix_response(
                common, min_mod_revision=after_revision + 1, limit=1, keys_only=True
            )
        except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise self._fail(f"read {common}", exc) from exc
        return bool(resp.kvs)

    def close(self) -> None:
        self._closed = True
        self._keep_alive.close()
        if self._ready is not None:
            self._ready.cancel()
        # Closing a broken channel must not mask the error that got us here.
        with contextlib.suppress(Exception):
            self._pyetcd.close()
