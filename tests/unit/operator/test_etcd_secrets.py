"""The two Secrets of a job's etcd as the operator builds and reads them (the API calls
themselves are proved on a real cluster in tests/e2e/test_operator.py)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from elasticjob_operator import builders, etcd_certs, etcd_secrets
from elasticjob_operator.builders import JobRef

REF = JobRef(name="train", namespace="ml", uid="uid-1")
ISSUED = etcd_certs.issue("train", "ml", "train-etcd", "train-worker", datetime.now(UTC))


def decoded(secret: dict[str, object]) -> dict[str, bytes]:
    data = secret["data"]
    assert isinstance(data, dict)
    return {k: base64.b64decode(v) for k, v in data.items()}


def test_the_server_secret_holds_what_etcd_serves_with_and_trusts() -> None:
    s = etcd_secrets.server_secret(REF, ISSUED)
    assert s["metadata"]["name"] == "train-etcd-server-tls"
    assert s["type"] == "kubernetes.io/tls"
    assert decoded(s) == {
        "ca.crt": ISSUED.ca_cert,
        "tls.crt": ISSUED.server_cert,
        "tls.key": ISSUED.server_key,
    }


def test_the_client_secret_holds_the_workers_certificate_not_the_servers_key() -> None:
    s = etcd_secrets.client_secret(REF, ISSUED)
    assert s["metadata"]["name"] == "train-etcd-client-tls"
    assert decoded(s) == {
        "ca.crt": ISSUED.ca_cert,
        "tls.crt": ISSUED.client_cert,
        "tls.key": ISSUED.client_key,
    }
    assert ISSUED.server_key not in decoded(s).values()


@pytest.mark.parametrize("build", [etcd_secrets.server_secret, etcd_secrets.client_secret])
def test_both_are_owned_by_the_job_so_they_go_with_it(build: object) -> None:
    s = build(REF, ISSUED)  # type: ignore[operator]
    assert s["metadata"]["namespace"] == "ml"
    assert s["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert etcd_secrets.owner_uid(s) == "uid-1"
    assert s["metadata"]["labels"][builders.LABEL_JOB] == "train"


def test_credentials_are_read_back_and_never_printed() -> None:
    creds = etcd_secrets.credentials_of(etcd_secrets.client_secret(REF, ISSUED), "ml/x")
    assert (creds.ca, creds.cert, creds.key) == (
        ISSUED.ca_cert,
        ISSUED.client_cert,
        ISSUED.client_key,
    )
    assert "PRIVATE KEY" not in repr(creds) and "BEGIN" not in repr(creds)
    assert "Secret ml/x" in creds.cert_from


def test_a_secret_missing_a_key_is_one_line_naming_it() -> None:
    broken = {"data": {"tls.crt": "eA==", "tls.key": "eA=="}}
    with pytest.raises(etcd_secrets.SecretsNotReady, match=r"^Secret ml/mine has no ca\.crt;"):
        etcd_secrets.credentials_of(broken, "ml/mine")
