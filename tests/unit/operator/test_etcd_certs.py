"""A job's etcd certificates: one CA per job, a server certificate for its Service and a
client certificate, each verified as a TLS library verifies them."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import (
    DNSName,
    IPAddress,
    PolicyBuilder,
    Store,
    VerificationError,
)

from elasticjob_operator.etcd import certs as etcd_certs

NOW = datetime(2026, 11, 23, 8, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def issued() -> etcd_certs.IssuedCerts:
    return etcd_certs.issue("train", "ml", "train-etcd", "train-worker", NOW)


@pytest.fixture(scope="module")
def other_job() -> etcd_certs.IssuedCerts:
    return etcd_certs.issue("other", "ml", "other-etcd", "other-worker", NOW)


def cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def verifier(ca_pem: bytes, at: datetime = NOW) -> PolicyBuilder:
    return PolicyBuilder().store(Store([cert(ca_pem)])).time(at)


SERVICE_NAMES = [
    "train-etcd",
    "train-etcd.ml",
    "train-etcd.ml.svc",
    "train-etcd.ml.svc.cluster.local",
    "localhost",
]


@pytest.mark.parametrize("name", SERVICE_NAMES)
def test_the_server_certificate_verifies_for_every_name_of_the_etcd_service(
    issued: etcd_certs.IssuedCerts, name: str
) -> None:
    chain = verifier(issued.ca_cert).build_server_verifier(DNSName(name))
    assert chain.verify(cert(issued.server_cert), [])[-1] == cert(issued.ca_cert)


def test_the_server_certificate_is_valid_for_loopback_by_ip_and_for_nothing_else(
    issued: etcd_certs.IssuedCerts,
) -> None:
    server = cert(issued.server_cert)
    v = verifier(issued.ca_cert)
    v.build_server_verifier(IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(server, [])
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == SERVICE_NAMES
    with pytest.raises(VerificationError):
        v.build_server_verifier(DNSName("other-etcd.ml.svc")).verify(server, [])


def test_the_client_certificate_verifies_as_a_client_of_its_own_ca_only(
    issued: etcd_certs.IssuedCerts, other_job: etcd_certs.IssuedCerts
) -> None:
    client = cert(issued.client_cert)
    verified = verifier(issued.ca_cert).build_client_verifier().verify(client, [])
    assert verified.chain[-1] == cert(issued.ca_cert)
    with pytest.raises(VerificationError):  # another job's etcd refuses it
        verifier(other_job.ca_cert).build_client_verifier().verify(client, [])


def test_key_usages_keep_clients_from_serving(issued: etcd_certs.IssuedCerts) -> None:
    def eku(pem: bytes) -> set[x509.ObjectIdentifier]:
        return set(cert(pem).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    assert eku(issued.client_cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    # etcd's own gRPC gateway dials etcd with the server certificate: it needs both
    assert eku(issued.server_cert) == {
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    }
    with pytest.raises(VerificationError):  # a worker's certificate cannot pose as etcd
        verifier(issued.ca_cert).build_server_verifier(DNSName("localhost")).verify(
            cert(issued.client_cert), []
        )
    ca = cert(issued.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    for leaf in (issued.server_cert, issued.client_cert):
        c = cert(leaf)
        assert not c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        usage = c.extensions.get_extension_for_class(x509.KeyUsage).value
        assert usage.digital_signature and not usage.key_cert_sign


def test_keys_match_their_certificates(issued: etcd_certs.IssuedCerts) -> None:
    for cert_pem, key_pem in (
        (issued.ca_cert, issued.ca_key),
        (issued.server_cert, issued.server_key),
        (issued.client_cert, issued.client_key),
    ):
        key = load_pem_private_key(key_pem, None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.public_key() == cert(cert_pem).public_key()


def test_a_client_certificate_issued_later_from_the_stored_ca_is_trusted_like_the_first(
    issued: etcd_certs.IssuedCerts, other_job: etcd_certs.IssuedCerts
) -> None:
    later = NOW + timedelta(days=30)
    again = etcd_certs.issue_client(
        "train", "ml", "train-worker", issued.ca_cert, issued.ca_key, later
    )
    client = cert(again.cert)
    verified = verifier(issued.ca_cert, later).build_client_verifier().verify(client, [])
    assert verified.chain[-1] == cert(issued.ca_cert)  # the same CA: the same etcd trusts it
    with pytest.raises(VerificationError):
        verifier(other_job.ca_cert, later).build_client_verifier().verify(client, [])
    key = load_pem_private_key(again.key, None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key() == client.public_key() != cert(issued.client_cert).public_key()
    first = cert(issued.client_cert)
    for ext in (x509.ExtendedKeyUsage, x509.SubjectAlternativeName, x509.KeyUsage):
        assert client.extensions.get_extension_for_class(ext) == (
            first.extensions.get_extension_for_class(ext)
        )
    assert client.subject == first.subject
    assert client.not_valid_after_utc == later + etcd_certs.VALIDITY


def test_a_client_certificate_needs_the_cas_own_key(
    issued: etcd_certs.IssuedCerts, other_job: etcd_certs.IssuedCerts
) -> None:
    with pytest.raises(ValueError, match=r"^the CA key is not the key of the CA certificate$"):
        etcd_certs.issue_client(
            "train", "ml", "train-worker", issued.ca_cert, other_job.ca_key, NOW
        )
    with pytest.raises(ValueError, match=r"^the CA certificate or key is not PEM"):
        etcd_certs.issue_client("train", "ml", "train-worker", issued.ca_cert, b"x", NOW)


def test_validity_starts_a_little_before_issuing_and_outlasts_any_job(
    issued: etcd_certs.IssuedCerts,
) -> None:
    for pem in (issued.ca_cert, issued.server_cert, issued.client_cert):
        c = cert(pem)
        assert c.not_valid_before_utc == NOW - etcd_certs.BACKDATE
        assert c.not_valid_after_utc == NOW + etcd_certs.VALIDITY
    later = NOW + timedelta(days=3 * 365)
    verifier(issued.ca_cert, later).build_client_verifier().verify(cert(issued.client_cert), [])


def test_every_job_gets_its_own_ca(
    issued: etcd_certs.IssuedCerts, other_job: etcd_certs.IssuedCerts
) -> None:
    assert cert(issued.ca_cert).public_key() != cert(other_job.ca_cert).public_key()
    again = etcd_certs.issue("train", "ml", "train-etcd", "train-worker", NOW)
    assert again.ca_cert != issued.ca_cert  # a new issue is a new CA, hence: never re-issue


def test_the_longest_names_kubernetes_allows_still_issue() -> None:
    """A common name may not pass 64 characters; namespace and names may reach 63 each."""
    ns, job = "n" * 63, "j" * 50
    now = datetime.now(UTC)
    issued = etcd_certs.issue(job, ns, f"{job}-etcd", f"{job}-worker", now)
    server = x509.load_pem_x509_certificate(issued.server_cert)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"{job}-etcd.{ns}.svc" in names.get_values_for_type(x509.DNSName)  # SANs whole
    shared = etcd_certs.issue_shared(ns, "r" * 63, now)
    etcd_certs.issue_client(job, ns, f"{job}-worker", shared.ca_cert, shared.ca_key, now)
