"""Where an etcd cluster is and how to trust it: plain data, no grpc.

The runtime's client (:mod:`elasticjob_runtime.etcd.client`) and the operator's reader
(:mod:`elasticjob_operator.etcd.reader`, which speaks etcd's JSON gateway so the operator
carries no grpc) parse endpoints and hold credentials the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TLSCredentials:
    """What a TLS connection to etcd trusts and presents (PEM bytes), and where each came
    from, for error messages. Never printed: ``repr`` shows only where they came from."""

    ca: bytes | None = field(default=None, repr=False)  # None: the system's roots
    cert: bytes | None = field(default=None, repr=False)  # None: no client certificate
    key: bytes | None = field(default=None, repr=False)
    ca_from: str = "the CA certificate"  # e.g. "ELASTICJOB_ETCD_CACERT=/etc/.../ca.crt"
    cert_from: str = "the client certificate and key"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str, default_port: int = 2379) -> list[Endpoint]:
    """Parse ``host[:port][,host[:port]...]``, the members of one etcd cluster.

    An ``http://`` scheme and a trailing ``/`` on a member are tolerated.
    """
    members = [_parse_member(p, default_port) for p in text.split(",") if p.strip()]
    if not members:
        raise ValueError("the etcd endpoint is empty; pass host:port, e.g. 127.0.0.1:2379")
    return members


def _parse_member(text: str, default_port: int) -> Endpoint:
    raw = text.strip()
    for scheme in ("http://", "https://"):
        if raw.startswith(scheme):
            raw = raw[len(scheme) :]
    raw = raw.rstrip("/")
    if not raw:
        raise ValueError(f"bad etcd endpoint {text!r}: no host; pass host:port, e.g. etcd:2379")
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        return Endpoint(raw, default_port)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad etcd endpoint {text!r}: the port must be a number from 1 to 65535")
    return Endpoint(host.strip("[]") or "127.0.0.1", int(port_text))
