"""The Secrets that hold a job's etcd certificates: built, created once, read back.

Two Secrets per job, both owned by the ElasticJob (the garbage collector deletes them
with it): ``<job>-etcd-server-tls`` (CA certificate and key, server certificate and key),
mounted only into the job's etcd pod and without the CA key (the volume's ``items``), and
``<job>-etcd-client-tls`` (CA, client certificate and key), mounted only into its worker
pods and read by the operator to read the job's progress.

Created, never changed (the operator may only get and create Secrets): the server Secret
first, then the client Secret. An operator restarted mid-job, and an etcd pod replaced
mid-job, find them and use them as they are. A server Secret without its client Secret
(an operator that stopped between the two creates, or a client Secret deleted mid-job)
gets a new client certificate from the CA key it holds; the job's etcd trusts it, and the
running workers keep their mounted copies, which are as good. A client Secret without
its server Secret means the server Secret was deleted: with it went the only CA key the
workers' certificates chain to, so that job must be created again.

With the chart's shared etcd (:mod:`elasticjob_operator.etcd.shared`) there is one more
Secret, in the operator's own namespace, issued when the operator starts: the shared
etcd's CA and key, its server certificate, the operator's client certificate and root's
password. A job that rendezvouses there has only a client Secret, issued from that CA
with the job's etcd user as its common name.

Nothing here logs or raises with a Secret's content: errors name the Secret and the API
status only.
"""

from __future__ import annotations

import base64
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from kubernetes.client.exceptions import ApiException

from elasticjob_operator import builders, models
from elasticjob_operator.etcd import certs as etcd_certs
from elasticjob_operator.etcd import shared as shared_etcd
from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.rest import Rest, path
from elasticjob_runtime.etcd.endpoints import TLSCredentials

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class SecretsNotReady(RuntimeError):
    """The job's certificate Secrets cannot be used yet; the message says why and what to
    do. The round is tried again at the next trigger."""


def _secret(ref: builders.JobRef, name: str, data: dict[str, bytes]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": builders.child_meta(ref, name, builders.etcd_selector(ref.name)),
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def server_secret(ref: builders.JobRef, issued: etcd_certs.IssuedCerts) -> Obj:
    """The etcd pod's Secret: what it serves with, the CA its clients must come from, and
    that CA's key (which the etcd pod does not mount) to issue clients again."""
    return _secret(
        ref,
        builders.etcd_server_secret_name(ref.name),
        {
            builders.TLS_CA: issued.ca_cert,
            builders.TLS_CA_KEY: issued.ca_key,
            builders.TLS_CERT: issued.server_cert,
            builders.TLS_KEY: issued.server_key,
        },
    )


def client_secret(ref: builders.JobRef, ca_cert: bytes, client: etcd_certs.ClientCert) -> Obj:
    """The workers' Secret: the CA that signed etcd's certificate and their own."""
    return _secret(
        ref,
        builders.etcd_client_secret_name(ref.name),
        {
            builders.TLS_CA: ca_cert,
            builders.TLS_CERT: client.cert,
            builders.TLS_KEY: client.key,
        },
    )


def ca_of(secret: Obj, name: str) -> tuple[bytes, bytes]:
    """The CA certificate and key in server Secret ``secret`` (keys ca.crt, ca.key)."""
    data = secret.get("data") or {}
    missing = [k for k in (builders.TLS_CA, builders.TLS_CA_KEY) if k not in data]
    if missing:
        raise SecretsNotReady(
            f"Secret {name} has no {', '.join(missing)}, so no client certificate can be "
            "issued for the job's etcd: delete the ElasticJob and create it again"
        )
    return base64.b64decode(data[builders.TLS_CA]), base64.b64decode(data[builders.TLS_CA_KEY])


@dataclass(frozen=True)
class SharedAuthority:
    """What the operator holds of the shared etcd: its CA and the CA's key (to issue the
    jobs' certificates), its own client certificate, root's password. Never logged."""

    ca_cert: bytes = field(repr=False)
    ca_key: bytes = field(repr=False)
    operator_tls: TLSCredentials = field(repr=False)
    root_password: str = field(repr=False)


# the shared Secret's keys beyond kubernetes.io/tls's: the operator's own client certificate
OPERATOR_CERT: Final = "operator.crt"
OPERATOR_KEY: Final = "operator.key"


def shared_secret(shared: SharedEtcd, issued: etcd_certs.IssuedCerts, password: str) -> Obj:
    """The shared etcd's Secret, in the operator's namespace: the etcd pod mounts ca.crt,
    tls.crt and tls.key only; the rest is the operator's."""
    data = {
        builders.TLS_CA: issued.ca_cert,
        builders.TLS_CA_KEY: issued.ca_key,
        builders.TLS_CERT: issued.server_cert,
        builders.TLS_KEY: issued.server_key,
        OPERATOR_CERT: issued.client_cert,
        OPERATOR_KEY: issued.client_key,
        shared_etcd.ROOT_PASSWORD_KEY: password.encode(),
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": shared.secret,
            "namespace": shared.namespace,
            "labels": {builders.LABEL_MANAGED_BY: builders.MANAGER},
        },
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def authority_of(secret: Obj, name: str) -> SharedAuthority:
    """What ``secret`` (the shared etcd's) gives the operator; SecretsNotReady naming the
    keys it lacks."""
    data = secret.get("data") or {}
    keys = (
        builders.TLS_CA,
        builders.TLS_CA_KEY,
        OPERATOR_CERT,
        OPERATOR_KEY,
        shared_etcd.ROOT_PASSWORD_KEY,
    )
    missing = [k for k in keys if k not in data]
    if missing:
        raise SecretsNotReady(
            f"Secret {name} has no {', '.join(missing)}: delete it and the shared etcd's pod "
            "(every job's rendezvous starts again), and the operator issues it anew"
        )
    raw = {k: base64.b64decode(data[k]) for k in keys}
    return SharedAuthority(
        ca_cert=raw[builders.TLS_CA],
        ca_key=raw[builders.TLS_CA_KEY],
        operator_tls=TLSCredentials(
            ca=raw[builders.TLS_CA],
            cert=raw[OPERATOR_CERT],
            key=raw[OPERATOR_KEY],
            ca_from=f"{builders.TLS_CA} of Secret {name}",
            cert_from=f"{OPERATOR_CERT} and {OPERATOR_KEY} of Secret {name}",
        ),
        root_password=raw[shared_etcd.ROOT_PASSWORD_KEY].decode(),
    )


def owner_uid(secret: Obj) -> str | None:
    refs = secret.get("metadata", {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)


def credentials_of(secret: Obj, name: str) -> TLSCredentials:
    """The CA and client certificate in ``secret`` (keys ca.crt, tls.crt, tls.key)."""
    data = secret.get("data") or {}
    missing = [k for k in (builders.TLS_CA, builders.TLS_CERT, builders.TLS_KEY) if k not in data]
    if missing:
        raise SecretsNotReady(
            f"Secret {name} has no {', '.join(missing)}; it needs ca.crt, tls.crt and tls.key"
        )
    return TLSCredentials(
        ca=base64.b64decode(data[builders.TLS_CA]),
        cert=base64.b64decode(data[builders.TLS_CERT]),
        key=base64.b64decode(data[builders.TLS_KEY]),
        ca_from=f"{builders.TLS_CA} of Secret {name}",
        cert_from=f"{builders.TLS_CERT} and {builders.TLS_KEY} of Secret {name}",
    )


def _api_error(what: str, exc: ApiException) -> SecretsNotReady:
    # the status and reason only: an ApiException's text carries the response body
    return SecretsNotReady(f"{what}: the API server answered {exc.status} {exc.reason}")


class EtcdSecrets:
    """Creates and reads the jobs' certificate Secrets through the Kubernetes API (verbs:
    get and create only); remembers the jobs whose Secrets are in place and the operator's
    own client credentials, which never change while a job exists."""

    def __init__(
        self,
        rest: Rest,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.rest = rest
        self._clock = clock
        self._lock = threading.Lock()
        self._ready: set[str] = set()  # job uids
        self._credentials: dict[tuple[str, str], TLSCredentials] = {}  # (job uid, Secret)

    def _get(self, namespace: str, name: str) -> Obj | None:
        try:
            return self.rest.get(path("v1", namespace, "secrets", name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _api_error(f"reading Secret {namespace}/{name}", exc) from None

    def _create(self, obj: Obj) -> bool:
        """Create ``obj``; False if its name is taken."""
        meta = obj["metadata"]
        try:
            self.rest.create(path("v1", meta["namespace"], "secrets"), obj)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise _api_error(f"creating Secret {meta['namespace']}/{meta['name']}", exc) from None
        return True

    def _owned(self, ref: builders.JobRef, secret: Obj | None, name: str) -> Obj | None:
        if secret is not None and owner_uid(secret) != ref.uid:
            raise SecretsNotReady(
                f"Secret {ref.namespace}/{name} belongs to another object (an earlier job of "
                "this name still being deleted?); waiting for it to go"
            )
        return secret

    def ensure(
        self,
        ref: builders.JobRef,
        recheck: bool = False,
        shared: SharedAuthority | None = None,
    ) -> None:
        """The job's two Secrets exist: issued now if neither did, a new client certificate
        if only the client Secret is gone. Looked up once per job, and again when
        ``recheck`` (a pod that mounts them is about to be created). A job of the
        ``shared`` etcd has only the client Secret, its certificate naming the job's etcd
        user."""
        with self._lock:
            if ref.uid in self._ready and not recheck:
                return
        if shared is not None:
            self._ensure_shared_client(ref, shared)
            return
        ns = ref.namespace
        server_name = builders.etcd_server_secret_name(ref.name)
        client_name = builders.etcd_client_secret_name(ref.name)
        server = self._owned(ref, self._get(ns, server_name), server_name)
        client = self._owned(ref, self._get(ns, client_name), client_name)
        if server is None and client is not None:
            raise SecretsNotReady(
                f"Secret {ns}/{server_name} was deleted; it held the only key of the CA the "
                f"job's certificates chain to, so no new one can be issued for its etcd: "
                f"delete the ElasticJob and create it again"
            )
        if client is None:
            now = self._clock()
            workers = builders.worker_service_name(ref.name)
            if server is None:
                issued = etcd_certs.issue(ref.name, ns, builders.etcd_name(ref.name), workers, now)
                # server first: it holds the CA key a lost client Secret is issued from again
                if not self._create(server_secret(ref, issued)):
                    raise SecretsNotReady(
                        f"Secret {ns}/{server_name} appeared while this operator issued it (two "
                        "operators at once?); trying again"
                    )
                ca_cert, client_cert = issued.ca_cert, issued.client
                said = f"issued the etcd's certificates (Secrets {server_name}, {client_name})"
            else:
                ca_cert, ca_key = ca_of(server, f"{ns}/{server_name}")
                try:
                    client_cert = etcd_certs.issue_client(
                        ref.name, ns, workers, ca_cert, ca_key, now
                    )
                except ValueError as exc:
                    raise SecretsNotReady(f"Secret {ns}/{server_name}: {exc}") from None
                said = (
                    f"Secret {client_name} was missing: issued a new client certificate from "
                    f"the CA in Secret {server_name}"
                )
            # taken meanwhile: another operator's, from the same CA (the server Secret's)
            self._create(client_secret(ref, ca_cert, client_cert))
            log.info("%s/%s: %s", ns, ref.name, said)
        with self._lock:
            self._ready.add(ref.uid)

    def _ensure_shared_client(self, ref: builders.JobRef, shared: SharedAuthority) -> None:
        ns, name = ref.namespace, builders.etcd_client_secret_name(ref.name)
        if self._owned(ref, self._get(ns, name), name) is None:
            cert = etcd_certs.issue_client(
                ref.name,
                ns,
                builders.worker_service_name(ref.name),
                shared.ca_cert,
                shared.ca_key,
                self._clock(),
                user=shared_etcd.user_of(ref.uid),
            )
            self._create(client_secret(ref, shared.ca_cert, cert))  # taken: of the same CA
            log.info(
                "%s/%s: issued its certificate for the shared etcd (Secret %s)", ns, ref.name, name
            )
        with self._lock:
            self._ready.add(ref.uid)

    def ensure_shared(self, shared: SharedEtcd) -> SharedAuthority:
        """The shared etcd's Secret exists (issued now if not: the etcd pod waits for it
        to mount) and what the operator needs of it."""
        secret = self._get(shared.namespace, shared.secret)
        if secret is None:
            issued = etcd_certs.issue_shared(shared.namespace, shared.service, self._clock())
            self._create(shared_secret(shared, issued, secrets.token_urlsafe(32)))
            log.info(
                "issued the shared etcd's certificates (Secret %s/%s)",
                shared.namespace,
                shared.secret,
            )
            secret = self._get(shared.namespace, shared.secret)  # ours, or another operator's
            if secret is None:
                raise SecretsNotReady(
                    f"Secret {shared.namespace}/{shared.secret} vanished after it was created"
                )
        return authority_of(secret, f"{shared.namespace}/{shared.secret}")

    def client_credentials(
        self, ref: builders.JobRef, spec: models.ElasticJobSpec
    ) -> TLSCredentials | None:
        """What the operator connects to the job's etcd with: the client Secret of the
        provisioned etcd or of spec.rdzvTLS; the system's roots for another https://
        endpoint; None for plain text."""
        name = builders.etcd_client_tls_secret(ref.name, spec)
        if name is None:
            endpoint = builders.rdzv_endpoint(ref, spec)
            return TLSCredentials() if "https://" in endpoint else None
        own = spec.provisions_etcd
        with self._lock:
            cached = self._credentials.get((ref.uid, name)) if own else None
        if cached is not None:
            return cached
        secret = self._get(ref.namespace, name)
        if secret is None:
            raise SecretsNotReady(f"Secret {ref.namespace}/{name} not found")
        creds = credentials_of(secret, f"{ref.namespace}/{name}")
        if own:  # ours never change; a user's Secret may be rotated, so it is read again
            with self._lock:
                if len(self._credentials) > 4096:
                    self._credentials.clear()
                self._credentials[(ref.uid, name)] = creds
        return creds
