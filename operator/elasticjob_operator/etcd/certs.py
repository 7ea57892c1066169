"""The certificates of a job's etcd: a CA of its own, a server and a client certificate.

Pure (the clock is a parameter): what the operator stores in the job's two Secrets
(:mod:`elasticjob_operator.etcd.secrets`). Each job gets a CA of its own, so a worker's
client certificate opens only its own job's etcd, never another job's.

The CA's private key is kept, in the job's server Secret only (never mounted into a
pod): with it a later operator issues the workers a new client certificate
(:func:`issue_client`) when the client Secret is gone (deleted mid-job, or the operator
stopped between the two creates), and the job's etcd trusts it, being of the same CA.
Keeping it costs nothing: whoever can read the job's Secrets can read the client key
already, which is all the etcd asks of a client. The certificates are never renewed,
hence the long :data:`VALIDITY`: a job's etcd must never start refusing its workers
mid-run, and its CA is trusted by that one etcd only and deleted with the job.

The chain itself (profile, keys, PEM) is :mod:`elasticjob_pki.x509_builder`'s, shared
with the devcluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elasticjob_pki import x509_builder as build
from elasticjob_pki.x509_builder import pem_cert, pem_key

# Ten years: longer than any job runs (there is no renewal; see the module docstring).
VALIDITY: Final = timedelta(days=3650)
BACKDATE: Final = build.BACKDATE
ORGANIZATION: Final = "elasticjob"


@dataclass(frozen=True)
class ClientCert:
    """PEM bytes of the workers' client certificate and its key."""

    cert: bytes
    key: bytes


@dataclass(frozen=True)
class IssuedCerts:
    """PEM bytes of one job's etcd certificates and of its CA's key."""

    ca_cert: bytes
    ca_key: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes

    @property
    def client(self) -> ClientCert:
        return ClientCert(self.client_cert, self.client_key)


def server_names(namespace: str, service: str) -> tuple[str, ...]:
    """DNS names the etcd's certificate is valid for: the Service ``service`` as a pod of
    the namespace, another namespace and the cluster domain name it, and localhost."""
    return (
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        "localhost",
    )


SERVER_IPS: Final = ("127.0.0.1",)


# X.509 allows no longer common name; the descriptive ones (a CA's, a server's) are cut
# to it, the ones etcd reads as a user (``job-<uid>``, 40 characters) always fit
CN_MAX: Final = 64


def _name(common_name: str | None) -> x509.Name:
    """O=elasticjob, and CN=``common_name`` (its first 64 characters) unless None."""
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION)]
    if common_name is not None:
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name[:CN_MAX]))
    return x509.Name(attributes)


def _server(
    namespace: str,
    service: str,
    ca: x509.Certificate,
    ca_key: build.Key,
    now: datetime,
) -> tuple[x509.Certificate, build.Key]:
    san = build.subject_alt_name(server_names(namespace, service), SERVER_IPS)
    server_key = build.new_key()
    server = build.leaf(
        _name(f"{service}.{namespace}.svc"),
        server_key,
        ca,
        ca_key,
        # etcd's gRPC gateway connects to etcd itself with the server certificate
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        now,
        VALIDITY,
        san,
    )
    return server, server_key


def issue(job: str, namespace: str, service: str, workers: str, now: datetime) -> IssuedCerts:
    """A new CA for job ``namespace/job``, the etcd's server certificate for the Service
    ``service`` (:func:`server_names`, 127.0.0.1) and the workers' client certificate,
    named for the workers' Service ``workers`` (a client certificate without a
    subjectAltName is refused by strict verifiers).

    The client certificate may only connect (EKU clientAuth): a worker cannot pose as the
    job's etcd. The server certificate may serve and connect (serverAuth, clientAuth):
    etcd's own gRPC gateway connects to etcd with it; it never leaves the etcd pod.
    """
    workers_name = (f"workers of {namespace}/{job}", f"{workers}.{namespace}.svc")
    return _issue(f"etcd CA of {namespace}/{job}", namespace, service, workers_name, now)


def issue_shared(namespace: str, service: str, now: datetime) -> IssuedCerts:
    """The shared etcd's CA and server certificate (Service ``service`` in the operator's
    ``namespace``), and a client certificate for the operator itself without a common
    name: the operator talks to etcd's JSON gateway, which with authentication on refuses
    a certificate that has one (it could not act as that user), and authenticates with
    root's password instead. Jobs get theirs from :func:`issue_client` with their user."""
    operator_name = (None, f"{service}.{namespace}.svc")
    return _issue(
        f"shared etcd CA of {namespace}/{service}", namespace, service, operator_name, now
    )


def _issue(
    ca_name: str,
    namespace: str,
    service: str,
    client_name: tuple[str | None, str],
    now: datetime,
) -> IssuedCerts:
    """A new CA, a server certificate for ``service`` and a client certificate named
    ``client_name`` (common name, DNS name)."""
    ca_key = build.new_key()
    ca = build.ca(_name(ca_name), ca_key, now, VALIDITY)
    server, server_key = _server(namespace, service, ca, ca_key, now)
    client = _client(*client_name, ca, ca_key, now)
    return IssuedCerts(
        ca_cert=pem_cert(ca),
        ca_key=pem_key(ca_key),
        server_cert=pem_cert(server),
        server_key=pem_key(server_key),
        client_cert=client.cert,
        client_key=client.key,
    )


def _client(
    common_name: str | None,
    dns_name: str,
    ca: x509.Certificate,
    ca_key: build.Key,
    now: datetime,
) -> ClientCert:
    key = build.new_key()
    cert = build.leaf(
        _name(common_name),
        key,
        ca,
        ca_key,
        [ExtendedKeyUsageOID.CLIENT_AUTH],
        now,
        VALIDITY,
        build.subject_alt_name([dns_name]),
    )
    return ClientCert(pem_cert(cert), pem_key(key))


def issue_client(
    job: str,
    namespace: str,
    workers: str,
    ca_cert: bytes,
    ca_key: bytes,
    now: datetime,
    user: str | None = None,
) -> ClientCert:
    """A new client certificate for the workers of ``namespace/job``, signed by the job's
    CA (``ca_cert``, ``ca_key``: PEM, as :func:`issue` made them), so the job's etcd
    trusts it as it trusts the first one. With ``user``, its common name is that etcd
    user (the shared etcd's, :mod:`elasticjob_operator.etcd.shared`). ValueError if the
    two are not a CA and its key.
    """
    ca, key = build.load_ca(ca_cert, ca_key)
    name = user if user is not None else f"workers of {namespace}/{job}"
    return _client(name, f"{workers}.{namespace}.svc", ca, key, now)
