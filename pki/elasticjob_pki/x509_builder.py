"""One way to build an X.509 chain: a CA, and leaf certificates it signs, pure (the clock
is a parameter).

The operator (a job's etcd, the shared etcd) and the devcluster (the API server, the node
agents, the components' client certificates) need the same thing, so both build it here
and a fix to the profile reaches both. The profile is the one Go's and OpenSSL's strict
verifiers accept: a CA that may only sign (``pathlen:0``, with a subject key identifier),
leaves that name it (authority key identifier), carry ``digitalSignature`` and say what
they may do (extended key usage). ECDSA P-256 keys: quick to generate and what etcd,
gRPC, Go's TLS and kube-apiserver all accept.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Final

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

# Valid from a little before issuing, so a machine whose clock lags the issuer's still
# accepts them.
BACKDATE: Final = timedelta(minutes=5)

Key = ec.EllipticCurvePrivateKey


def new_key() -> Key:
    return ec.generate_private_key(ec.SECP256R1())


def _key_usage(*, sign_certs: bool) -> x509.KeyUsage:
    """A CA signs certificates and CRLs only; a leaf signs its TLS handshakes only."""
    return x509.KeyUsage(
        digital_signature=not sign_certs,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=sign_certs,
        crl_sign=sign_certs,
        encipher_only=False,
        decipher_only=False,
    )


def ca(subject: x509.Name, key: Key, now: datetime, validity: timedelta) -> x509.Certificate:
    """A self-signed CA named ``subject``, valid ``validity`` from ``now``."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(sign_certs=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )


def subject_alt_name(
    dns_names: Sequence[str], ips: Sequence[str] = ()
) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    return x509.SubjectAlternativeName(names)


def leaf(
    subject: x509.Name,
    key: Key,
    issuer: x509.Certificate,
    issuer_key: Key,
    usages: Sequence[x509.ObjectIdentifier],
    now: datetime,
    validity: timedelta,
    san: x509.SubjectAlternativeName | None = None,
) -> x509.Certificate:
    """A certificate for ``key`` named ``subject``, signed by the CA ``issuer``, that may
    do ``usages`` (serverAuth, clientAuth), for the names in ``san`` if any."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign_certs=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def pem_key(key: Key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def load_ca(cert_pem: bytes, key_pem: bytes) -> tuple[x509.Certificate, Key]:
    """A CA and its key from PEM, as :func:`pem_cert` and :func:`pem_key` wrote them.
    ValueError if they are not PEM, or the key is not the certificate's."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("the CA certificate or key is not PEM as the operator writes it") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ValueError("the CA key is not the key of the CA certificate")
    return cert, key
