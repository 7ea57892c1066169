"""Which TLS a connection to etcd uses, and the one way the runtime opens an etcd client.

Every path that talks to etcd (the rendezvous handler and its lease keeper, the etcd
store, progress, node-memory reports, the launcher's check) opens its client through
:func:`connect` or :func:`open_client`, so none of them can forget the TLS settings.

TLS is on when the endpoint says ``https://``, when ``--rdzv-conf protocol=https``, or
when any certificate file is given. The files come from ``--rdzv-conf`` (torch's own etcd
rendezvous reads the same keys: ``cacert``, ``cert``, ``key``) or else from
``ELASTICJOB_ETCD_CACERT`` / ``ELASTICJOB_ETCD_CERT`` / ``ELASTICJOB_ETCD_KEY``, which the
operator sets. Without a CA file the system's roots verify etcd (server authentication
only, as for a managed etcd); without a certificate and key no client certificate is
shown.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.endpoints import Endpoint, TLSCredentials, parse_endpoints

# torch's etcd rendezvous's rdzv_conf keys (torch.distributed.elastic.rendezvous.etcd_*)
CONF_PROTOCOL: Final = "protocol"
CONF_CACERT: Final = "cacert"
CONF_CERT: Final = "cert"
CONF_KEY: Final = "key"


@dataclass(frozen=True)
class EtcdTLS:
    """The files a TLS connection to etcd uses (None: not given) and the setting that
    named each, e.g. ``ELASTICJOB_ETCD_CACERT`` or ``--rdzv-conf cacert``."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    cacert_from: str = contract.ETCD_CACERT
    cert_from: str = contract.ETCD_CERT
    key_from: str = contract.ETCD_KEY


def parse_conf(text: str) -> dict[str, str]:
    """``key=value,key=value`` as ``--rdzv-conf`` / ``PET_RDZV_CONF`` give it (torch
    reports malformed pairs itself, later; they are skipped here)."""
    pairs = (p.split("=", 1) for p in (text or "").split(",") if "=" in p)
    return {k.strip(): v.strip() for k, v in pairs if k.strip()}


def _scheme(endpoint: str) -> str | None:
    """``https``, ``http`` or None (no scheme) for the whole member list."""
    found = {m.strip().split("://", 1)[0].lower() for m in endpoint.split(",") if "://" in m}
    if len(found) > 1:
        raise ValueError(f"etcd endpoint {endpoint!r} mixes http:// and https://; use one")
    return found.pop() if found else None


def _setting(
    conf: Mapping[str, object], env: Mapping[str, str], key: str, var: str
) -> tuple[str | None, str]:
    raw = conf.get(key)
    if raw is not None and str(raw).strip():
        return str(raw).strip(), f"--rdzv-conf {key}"
    value = env.get(var, "").strip()
    return (value or None), var


def tls_settings(
    endpoint: str, conf: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None
) -> EtcdTLS | None:
    """The TLS settings for ``endpoint`` from ``conf`` (rdzv_conf) and ``env``; None for
    plain text. Raises ValueError, one line, when they contradict each other."""
    conf = conf or {}
    env = os.environ if env is None else env
    scheme = _scheme(endpoint)
    protocol = str(conf.get(CONF_PROTOCOL) or "").strip().lower() or None
    if protocol not in (None, "http", "https"):
        raise ValueError(f"--rdzv-conf protocol={protocol}: must be http or https")
    if protocol and scheme and protocol != scheme:
        raise ValueError(
            f"--rdzv-conf protocol={protocol} contradicts the endpoint {endpoint!r}; "
            "drop one of them"
        )
    cacert, cacert_from = _setting(conf, env, CONF_CACERT, contract.ETCD_CACERT)
    cert, cert_from = _setting(conf, env, CONF_CERT, contract.ETCD_CERT)
    key, key_from = _setting(conf, env, CONF_KEY, contract.ETCD_KEY)
    wants_tls = "https" in (scheme, protocol)
    files = cacert or cert or key
    if (scheme or protocol) == "http":
        if files:
            given = cacert_from if cacert else cert_from if cert else key_from
            raise ValueError(
                f"{given} is set but the etcd endpoint {endpoint!r} is plain http; use an "
                f"https:// endpoint, or unset {given}"
            )
        return None
    if not wants_tls and not files:
        return None
    if bool(cert) != bool(key):
        have, missing = (cert_from, key_from) if cert else (key_from, cert_from)
        raise ValueError(
            f"{have} is set but {missing} is not; a client certificate needs both its "
            "certificate and its key"
        )
    return EtcdTLS(cacert, cert, key, cacert_from, cert_from, key_from)


def tls_environ(tls: EtcdTLS | None) -> dict[str, str]:
    """The ``ELASTICJOB_ETCD_*`` variables that tell child processes the same files."""
    if tls is None:
        return {}
    pairs = ((contract.ETCD_CACERT, tls.cacert), (contract.ETCD_CERT, tls.cert))
    return {name: value for name, value in (*pairs, (contract.ETCD_KEY, tls.key)) if value}


_PEM_MARKERS: Final = {
    "CA certificate": b"-----BEGIN CERTIFICATE-----",
    "client certificate": b"-----BEGIN CERTIFICATE-----",
    "client key": b"PRIVATE KEY-----",
}


def _read(path: str | None, setting: str, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise EtcdError(
            f"cannot read the etcd {what} {path} ({setting}): {exc.strerror or exc}; "
            f"point {setting} at a readable PEM file"
        ) from None
    if _PEM_MARKERS[what] not in data:
        raise EtcdError(f"the etcd {what} {path} ({setting}) is not in PEM format")
    return data


def credentials(tls: EtcdTLS) -> TLSCredentials:
    """Read the files; a missing or unreadable one is one EtcdError line naming it and the
    setting that named it (never its content)."""
    return TLSCredentials(
        ca=_read(tls.cacert, tls.cacert_from, "CA certificate"),
        cert=_read(tls.cert, tls.cert_from, "client certificate"),
        key=_read(tls.key, tls.key_from, "client key"),
        ca_from=f"{tls.cacert_from}={tls.cacert}" if tls.cacert else "the system's roots",
        cert_from=f"{tls.cert_from}={tls.cert}" if tls.cert else "the client certificate",
    )


def open_client(
    endpoints: Sequence[Endpoint],
    tls: EtcdTLS | None,
    *,
    timeout: float = 5.0,
    reconnect_within: float | None = None,
) -> EtcdClient:
    """An etcd client for ``endpoints`` with the TLS of ``tls`` (None: plain text)."""
    creds = credentials(tls) if tls is not None else None
    return EtcdClient(endpoints, timeout=timeout, reconnect_within=reconnect_within, tls=creds)


def connect(
    endpoint: str,
    conf: Mapping[str, object] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 5.0,
    reconnect_within: float | None = None,
) -> EtcdClient:
    """An etcd client for ``endpoint`` (``host:port[,...]``, optionally ``https://``) with
    the TLS that ``conf`` and ``env`` (default: this process's) say. Bad settings raise
    ValueError (contradictions) or EtcdError (files), each one line."""
    return open_client(
        parse_endpoints(endpoint, contract.DEFAULT_ETCD_PORT),
        tls_settings(endpoint, conf, env),
        timeout=timeout,
        reconnect_within=reconnect_within,
    )
