"""The shared etcd's rules: which jobs use it, each job's user and keys, the users of
gone jobs; and what a round creates for a job that uses it. (The users in a real
etcd with authentication on: tests/integration/rendezvous/test_shared_etcd_auth.py.)"""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from elasticjob_operator import builders, models
from elasticjob_operator.builders import JobRef
from elasticjob_operator.etcd import certs as etcd_certs
from elasticjob_operator.etcd import secrets as etcd_secrets
from elasticjob_operator.etcd import shared as shared_etcd
from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.observe import Observed
from elasticjob_operator.reconcile import Config, reconcile, shared_etcd_of
from elasticjob_runtime import contract

NOW = datetime(2026, 11, 23, tzinfo=UTC)
SHARED = SharedEtcd("ops", "rel-elasticjob-operator-etcd", "rel-elasticjob-operator-etcd-tls")
REF = JobRef(name="train", namespace="ml", uid=str(uuid.UUID(int=1)))


def make_spec(**over: Any) -> models.ElasticJobSpec:
    raw: dict[str, Any] = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "replicaSpecs": {
            "Worker": {"template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}}
        },
        **over,
    }
    return models.ElasticJobSpec.model_validate(raw)


def test_the_chart_names_it_in_three_variables_or_none() -> None:
    assert shared_etcd.from_env({}) is None
    env = {
        "ELASTICJOB_SHARED_ETCD_SERVICE": SHARED.service,
        "ELASTICJOB_SHARED_ETCD_SECRET": SHARED.secret,
        "ELASTICJOB_OPERATOR_NAMESPACE": "ops",
    }
    got = shared_etcd.from_env(env)
    assert got == SHARED
    assert got.endpoint == "https://rel-elasticjob-operator-etcd.ops.svc:2379"
    with pytest.raises(ValueError, match="ELASTICJOB_SHARED_ETCD_SECRET"):
        shared_etcd.from_env({"ELASTICJOB_SHARED_ETCD_SERVICE": "etcd"})


def test_only_jobs_without_an_endpoint_or_an_etcd_of_their_own_use_it() -> None:
    assert shared_etcd.serves(make_spec(), SHARED, runs_own_etcd=False) == SHARED
    assert shared_etcd.serves(make_spec(), None, runs_own_etcd=False) is None
    assert shared_etcd.serves(make_spec(), SHARED, runs_own_etcd=True) is None  # kept
    assert shared_etcd.serves(make_spec(rdzvEndpoint="etcd:2379"), SHARED, False) is None
    assert shared_etcd.serves(make_spec(rdzvBackend="c10d"), SHARED, False) is None


def test_a_jobs_keys_are_every_run_of_its_own_and_none_of_another_jobs() -> None:
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    start = shared_etcd.key_prefix(a)
    end = shared_etcd.prefix_end(start)
    for run in (models.run_id(a, 0), models.run_id(a, 3)):
        for key in (contract.progress_key(run), contract.hang_key(run, 7)):
            assert start <= key.encode() < end
    for key in (contract.progress_key(b), contract.progress_key(models.run_id(b, 1)), "/x"):
        assert not start <= key.encode() < end


def test_users_of_gone_jobs_are_stale_and_root_never_is() -> None:
    live, gone = str(uuid.uuid4()), str(uuid.uuid4())
    users = ["root", shared_etcd.user_of(live), shared_etcd.user_of(gone), "someone"]
    assert shared_etcd.stale_users(users, {live}) == [shared_etcd.user_of(gone)]
    assert shared_etcd.uid_of(shared_etcd.user_of(live)) == live
    assert shared_etcd.uid_of("root") is None


def test_a_round_creates_no_etcd_and_points_the_workers_at_the_shared_one() -> None:
    config = Config(shared_etcd=SHARED)
    shared = shared_etcd_of(REF, make_spec(), Observed(), config)
    assert shared == SHARED
    d = reconcile(REF, 1, make_spec(), models.ElasticJobStatus(), Observed(), NOW, config, shared)
    kinds = sorted(o["kind"] for o in d.create)
    assert "Deployment" not in kinds and kinds.count("Service") == 1  # the workers' only
    pods = [o for o in d.create if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env[contract.RDZV_ENDPOINT] == SHARED.endpoint
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        secret = volumes[builders.ETCD_TLS_VOLUME]["secret"]["secretName"]
        assert secret == builders.etcd_client_secret_name(REF.name)


def test_a_job_running_its_own_etcd_keeps_it_when_the_shared_one_appears() -> None:
    observed = Observed(deployments=frozenset({builders.etcd_name(REF.name)}))
    config = Config(shared_etcd=SHARED)
    shared = shared_etcd_of(REF, make_spec(), observed, config)
    assert shared is None
    d = reconcile(REF, 1, make_spec(), models.ElasticJobStatus(), observed, NOW, config, shared)
    own = f"https://{builders.etcd_name(REF.name)}.ml.svc:2379"
    for pod in (o for o in d.create if o["kind"] == "Pod"):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env[contract.RDZV_ENDPOINT] == own


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def test_the_shared_secret_holds_what_the_operator_needs_and_reads_back() -> None:
    issued = etcd_certs.issue_shared(SHARED.namespace, SHARED.service, NOW)
    secret = etcd_secrets.shared_secret(SHARED, issued, "s3cret")
    assert "ownerReferences" not in secret["metadata"]  # lives with the release
    authority = etcd_secrets.authority_of(secret, "ops/x")
    assert authority.root_password == "s3cret"
    assert authority.ca_cert == issued.ca_cert and authority.ca_key == issued.ca_key
    assert "s3cret" not in repr(authority) and "PRIVATE" not in repr(authority)
    del secret["data"][shared_etcd.ROOT_PASSWORD_KEY]
    with pytest.raises(etcd_secrets.SecretsNotReady, match="root-password"):
        etcd_secrets.authority_of(secret, "ops/x")


def test_a_jobs_certificate_from_the_shared_ca_names_its_etcd_user() -> None:
    issued = etcd_certs.issue_shared(SHARED.namespace, SHARED.service, NOW)
    user = shared_etcd.user_of(REF.uid)
    client = etcd_certs.issue_client(
        "train", "ml", "train-worker", issued.ca_cert, issued.ca_key, NOW, user=user
    )
    cert = x509.load_pem_x509_certificate(client.cert)
    (cn,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert cn.value == user  # etcd takes the user from the common name
    ca = x509.load_pem_x509_certificate(issued.ca_cert)
    cert.verify_directly_issued_by(ca)
    # the operator's own certificate names no user (the gateway refuses one that does):
    # it authenticates with root's password
    operator = x509.load_pem_x509_certificate(issued.client_cert)
    assert not operator.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
