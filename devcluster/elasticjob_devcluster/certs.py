"""The devcluster's PKI: one CA, serving certs for the API server and node agents,
client certs for each component, and the service-account signing key pair.

Generated once per cluster directory with the ``cryptography`` library, so no
openssl invocation or config file is involved and every name is visible here; the chain
is built by :mod:`elasticjob_pki.x509_builder`, as the operator builds its etcds'.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elasticjob_pki import x509_builder as build

_VALIDITY = dt.timedelta(days=365)
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
APISERVER_IPS = ("127.0.0.1", "10.96.0.1")


@dataclass(frozen=True)
class KeyPair:
    """Paths of a PEM certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPKI:
    """Every credential file of one devcluster, under ``<dir>/pki``."""

    dir: Path

    @property
    def ca(self) -> KeyPair:
        return KeyPair(self.dir / "ca.crt", self.dir / "ca.key")

    @property
    def apiserver(self) -> KeyPair:
        return KeyPair(self.dir / "apiserver.crt", self.dir / "apiserver.key")

    @property
    def apiserver_kubelet_client(self) -> KeyPair:
        return KeyPair(
            self.dir / "apiserver-kubelet-client.crt", self.dir / "apiserver-kubelet-client.key"
        )

    @property
    def kubelet(self) -> KeyPair:
        """Serving cert shared by the node agents (all listen on 127.0.0.1)."""
        return KeyPair(self.dir / "kubelet.crt", self.dir / "kubelet.key")

    @property
    def admin(self) -> KeyPair:
        return KeyPair(self.dir / "admin.crt", self.dir / "admin.key")

    @property
    def controller_manager(self) -> KeyPair:
        return KeyPair(self.dir / "controller-manager.crt", self.dir / "controller-manager.key")

    def node_agent(self, node: str) -> KeyPair:
        return KeyPair(self.dir / f"node-{node}.crt", self.dir / f"node-{node}.key")

    @property
    def kueue(self) -> KeyPair:
        """Kueue's client certificate (it reads and writes across every namespace)."""
        return KeyPair(self.dir / "kueue.crt", self.dir / "kueue.key")

    @property
    def kueue_serving(self) -> KeyPair:
        """Kueue's serving certificate, named as its manager reads it from a directory."""
        return KeyPair(
            self.dir / "kueue-serving" / "tls.crt", self.dir / "kueue-serving" / "tls.key"
        )

    @property
    def service_account_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.dir / "sa.pub"


def write_private(path: Path, data: bytes) -> None:
    """Write a file that holds a key: mode 0600 from the moment it exists (no window in
    which others could read it), also when it existed before with another mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, path: Path) -> None:
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _load_ca(pki: ClusterPKI) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    return build.load_ca(pki.ca.cert.read_bytes(), pki.ca.key.read_bytes())


def _issue(
    pki: ClusterPKI,
    pair: KeyPair,
    subject: x509.Name,
    *,
    server: bool = False,
    client: bool = False,
    dns_names: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
) -> None:
    ca_cert, ca_key = _load_ca(pki)
    key = build.new_key()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    san = build.subject_alt_name(dns_names, ips) if dns_names or ips else None
    now = dt.datetime.now(dt.UTC)
    cert = build.leaf(subject, key, ca_cert, ca_key, usages, now, _VALIDITY, san)
    _write_key(key, pair.key)
    pair.cert.write_bytes(build.pem_cert(cert))


def _create_ca(pki: ClusterPKI) -> None:
    key = build.new_key()
    cert = build.ca(_name("elasticjob-devcluster-ca"), key, dt.datetime.now(dt.UTC), _VALIDITY)
    _write_key(key, pki.ca.key)
    pki.ca.cert.write_bytes(build.pem_cert(cert))


def ensure_node_agent_cert(pki: ClusterPKI, node: str) -> KeyPair:
    """Client cert a node agent uses; it binds pods and mints tokens, so it is an admin."""
    pair = pki.node_agent(node)
    if not pair.cert.exists():
        _issue(pki, pair, _name(f"elasticjob-node-agent:{node}", "system:masters"), client=True)
    return pair


def ensure_kueue_certs(pki: ClusterPKI) -> None:
    """Kueue's client and serving (127.0.0.1) certificates, once."""
    if not pki.kueue.cert.exists():
        _issue(pki, pki.kueue, _name("kueue", "system:masters"), client=True)
    serving = pki.kueue_serving
    if not serving.cert.exists():
        serving.cert.parent.mkdir(parents=True, exist_ok=True)
        _issue(pki, serving, _name("kueue-webhook"), server=True, ips=("127.0.0.1",))


def ensure_pki(directory: Path) -> ClusterPKI:
    """Create the PKI under ``directory`` unless it already exists; idempotent."""
    pki = ClusterPKI(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not pki.ca.cert.exists():
        _create_ca(pki)
    if not pki.apiserver.cert.exists():
        _issue(
            pki,
            pki.apiserver,
            _name("kube-apiserver"),
            server=True,
            dns_names=APISERVER_DNS_NAMES,
            ips=APISERVER_IPS,
        )
    if not pki.apiserver_kubelet_client.cert.exists():
        _issue(
            pki,
            pki.apiserver_kubelet_client,
            _name("kube-apiserver-kubelet-client", "system:masters"),
            client=True,
        )
    if not pki.kubelet.cert.exists():
        _issue(pki, pki.kubelet, _name("elasticjob-node-agent"), server=True, ips=("127.0.0.1",))
    if not pki.admin.cert.exists():
        _issue(pki, pki.admin, _name("kubernetes-admin", "system:masters"), client=True)
    if not pki.controller_manager.cert.exists():
        _issue(pki, pki.controller_manager, _name("system:kube-controller-manager"), client=True)
    if not pki.service_account_key.exists():
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(sa, pki.service_account_key)
        pki.service_account_pub.write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return pki
