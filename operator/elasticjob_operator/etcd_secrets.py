"""The Secrets that hold a job's etcd certificates: built, created once, read back.

Two Secrets per job, both owned by the ElasticJob (the garbage collector deletes them
with it): ``<job>-etcd-server-tls`` (CA, server certificate and key), mounted only into
the job's etcd pod, and ``<job>-etcd-client-tls`` (CA, client certificate and key),
mounted only into its worker pods and read by the operator to read the job's progress.

Issued once per job (:mod:`elasticjob_operator.etcd_certs`): an operator restarted
mid-job, and an etcd pod replaced mid-job, find the Secrets and use them as they are.
The client Secret is created first, so a server Secret never exists without its client
Secret; a client Secret alone is the trace of an operator that stopped in between, and
since no etcd can have started without the server Secret, it is replaced.

Nothing here logs or raises with a Secret's content: errors name the Secret and the API
status only.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

import kubernetes
from kubernetes.client.exceptions import ApiException

from elasticjob_operator import builders, etcd_certs, models
from elasticjob_runtime.etcd_client import TLSCredentials

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
        "metadata": {
            "name": name,
            "namespace": ref.namespace,
            "labels": {
                **builders.etcd_selector(ref.name),
                builders.LABEL_MANAGED_BY: builders.MANAGER,
            },
            "ownerReferences": [ref.owner_reference()],
        },
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def server_secret(ref: builders.JobRef, issued: etcd_certs.IssuedCerts) -> Obj:
    """The etcd pod's Secret: what it serves with and the CA its clients must come from."""
    return _secret(
        ref,
        builders.etcd_server_secret_name(ref.name),
        {
            builders.TLS_CA: issued.ca_cert,
            builders.TLS_CERT: issued.server_cert,
            builders.TLS_KEY: issued.server_key,
        },
    )


def client_secret(ref: builders.JobRef, issued: etcd_certs.IssuedCerts) -> Obj:
    """The workers' Secret: the CA that signed etcd's certificate and their own."""
    return _secret(
        ref,
        builders.etcd_client_secret_name(ref.name),
        {
            builders.TLS_CA: issued.ca_cert,
            builders.TLS_CERT: issued.client_cert,
            builders.TLS_KEY: issued.client_key,
        },
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
    get, create, update); remembers the jobs whose Secrets are in place and the operator's
    own client credentials, which never change while a job exists."""

    def __init__(
        self,
        core: kubernetes.client.CoreV1Api,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.core = core
        self._clock = clock
        self._lock = threading.Lock()
        self._ready: set[str] = set()  # job uids
        self._credentials: dict[tuple[str, str], TLSCredentials] = {}  # (job uid, Secret)

    def _get(self, namespace: str, name: str) -> Obj | None:
        try:
            resp: Any = self.core.read_namespaced_secret(name, namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise _api_error(f"reading Secret {namespace}/{name}", exc) from None
        return cast(Obj, json.loads(resp.data))

    def _create(self, obj: Obj, replace: bool = False) -> bool:
        """Create ``obj``; False if its name is taken (and ``replace`` is not asked)."""
        meta = obj["metadata"]
        try:
            self.core.create_namespaced_secret(meta["namespace"], cast(Any, obj))
            return True
        except ApiException as exc:
            if exc.status != 409:
                raise _api_error(
                    f"creating Secret {meta['namespace']}/{meta['name']}", exc
                ) from None
        if not replace:
            return False
        try:
            self.core.replace_namespaced_secret(meta["name"], meta["namespace"], cast(Any, obj))
        except ApiException as exc:
            raise _api_error(f"replacing Secret {meta['namespace']}/{meta['name']}", exc) from None
        return True

    def _owned(self, ref: builders.JobRef, secret: Obj | None, name: str) -> Obj | None:
        if secret is not None and owner_uid(secret) != ref.uid:
            raise SecretsNotReady(
                f"Secret {ref.namespace}/{name} belongs to another object (an earlier job of "
                "this name still being deleted?); waiting for it to go"
            )
        return secret

    def ensure(self, ref: builders.JobRef) -> None:
        """The job's two Secrets exist, issued now if they did not; never re-issued."""
        with self._lock:
            if ref.uid in self._ready:
                return
        ns = ref.namespace
        server_name = builders.etcd_server_secret_name(ref.name)
        client_name = builders.etcd_client_secret_name(ref.name)
        server = self._owned(ref, self._get(ns, server_name), server_name)
        client = self._owned(ref, self._get(ns, client_name), client_name)
        if server is None:
            issued = etcd_certs.issue(
                ref.name,
                ns,
                builders.etcd_name(ref.name),
                builders.worker_service_name(ref.name),
                self._clock(),
            )
            # client first: a server Secret never exists without the client one
            self._create(client_secret(ref, issued), replace=client is not None)
            if not self._create(server_secret(ref, issued)):
                raise SecretsNotReady(
                    f"Secret {ns}/{server_name} appeared while this operator issued it (two "
                    "operators at once?); trying again"
                )
            log.info(
                "%s/%s: issued the etcd's certificates (Secrets %s, %s)",
                ns,
                ref.name,
                server_name,
                client_name,
            )
        elif client is None:
            raise SecretsNotReady(
                f"Secret {ns}/{client_name} was deleted while the job's etcd runs with "
                f"certificates of its own CA; no new one can be issued for it: delete the "
                f"ElasticJob and create it again"
            )
        with self._lock:
            self._ready.add(ref.uid)

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
