"""The two Secrets of a job's etcd as the operator builds and reads them (the API calls
themselves are proved on a real cluster in tests/e2e/test_operator.py)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store

from elasticjob_devcluster.volumes import materialise
from elasticjob_operator import builders
from elasticjob_operator.builders import JobRef, Obj
from elasticjob_operator.etcd import certs as etcd_certs
from elasticjob_operator.etcd import secrets as etcd_secrets
from elasticjob_operator.models import ElasticJobSpec

NOW = datetime.now(UTC)
REF = JobRef(name="train", namespace="ml", uid="uid-1")
ISSUED = etcd_certs.issue("train", "ml", "train-etcd", "train-worker", NOW)
SPEC = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "replicaSpecs": {
        "Worker": {
            "replicas": 1,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "img"}]}},
        }
    },
}


def decoded(secret: dict[str, object]) -> dict[str, bytes]:
    data = secret["data"]
    assert isinstance(data, dict)
    return {k: base64.b64decode(v) for k, v in data.items()}


def test_the_server_secret_holds_what_etcd_serves_with_and_trusts_and_the_ca_key() -> None:
    s = etcd_secrets.server_secret(REF, ISSUED)
    assert s["metadata"]["name"] == "train-etcd-server-tls"
    assert s["type"] == "kubernetes.io/tls"
    assert decoded(s) == {
        "ca.crt": ISSUED.ca_cert,
        "ca.key": ISSUED.ca_key,
        "tls.crt": ISSUED.server_cert,
        "tls.key": ISSUED.server_key,
    }
    assert etcd_secrets.ca_of(s, "ml/x") == (ISSUED.ca_cert, ISSUED.ca_key)


def test_the_etcd_pod_mounts_its_server_secret_without_the_ca_key(tmp_path: Path) -> None:
    """As a node mounts it (the devcluster's node agent, which honours ``items`` as the
    kubelet does): the three files etcd reads, not the CA key."""
    deployment = builders.etcd_deployment(REF, ElasticJobSpec.model_validate(SPEC))
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    secrets = {"train-etcd-server-tls": etcd_secrets.server_secret(REF, ISSUED)}
    materialise(volume, tmp_path, {}, {}, secrets, pvc_root=tmp_path / "pvc", token=lambda *_: "")
    files = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    assert files == {
        "ca.crt": ISSUED.ca_cert,
        "tls.crt": ISSUED.server_cert,
        "tls.key": ISSUED.server_key,
    }


def test_the_client_secret_holds_the_workers_certificate_not_the_servers_or_cas_key() -> None:
    s = etcd_secrets.client_secret(REF, ISSUED.ca_cert, ISSUED.client)
    assert s["metadata"]["name"] == "train-etcd-client-tls"
    assert decoded(s) == {
        "ca.crt": ISSUED.ca_cert,
        "tls.crt": ISSUED.client_cert,
        "tls.key": ISSUED.client_key,
    }
    assert ISSUED.server_key not in decoded(s).values()
    assert ISSUED.ca_key not in decoded(s).values()


def test_a_client_secret_issued_again_from_the_server_secret_chains_to_the_same_ca() -> None:
    ca_cert, ca_key = etcd_secrets.ca_of(etcd_secrets.server_secret(REF, ISSUED), "ml/x")
    again = etcd_certs.issue_client("train", "ml", "train-worker", ca_cert, ca_key, NOW)
    s = decoded(etcd_secrets.client_secret(REF, ca_cert, again))
    assert s["ca.crt"] == ISSUED.ca_cert and s["tls.crt"] != ISSUED.client_cert
    ca = x509.load_pem_x509_certificate(ISSUED.ca_cert)
    verified = (
        PolicyBuilder()
        .store(Store([ca]))
        .time(NOW)
        .build_client_verifier()
        .verify(x509.load_pem_x509_certificate(s["tls.crt"]), [])
    )
    assert verified.chain[-1] == ca


def test_a_server_secret_without_the_ca_key_is_one_line_naming_it() -> None:
    s = etcd_secrets.server_secret(REF, ISSUED)
    del s["data"]["ca.key"]
    with pytest.raises(
        etcd_secrets.SecretsNotReady,
        match=r"^Secret ml/train-etcd-server-tls has no ca\.key, so no client certificate "
        r"can be issued for the job's etcd: delete the ElasticJob and create it again$",
    ):
        etcd_secrets.ca_of(s, "ml/train-etcd-server-tls")


@pytest.mark.parametrize(
    "build",
    [
        lambda: etcd_secrets.server_secret(REF, ISSUED),
        lambda: etcd_secrets.client_secret(REF, ISSUED.ca_cert, ISSUED.client),
    ],
)
def test_both_are_owned_by_the_job_so_they_go_with_it(build: Callable[[], Obj]) -> None:
    s = build()
    assert s["metadata"]["namespace"] == "ml"
    assert s["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert etcd_secrets.owner_uid(s) == "uid-1"
    assert s["metadata"]["labels"][builders.LABEL_JOB] == "train"


def test_credentials_are_read_back_and_never_printed() -> None:
    secret = etcd_secrets.client_secret(REF, ISSUED.ca_cert, ISSUED.client)
    creds = etcd_secrets.credentials_of(secret, "ml/x")
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
