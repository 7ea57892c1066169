"""The job's NetworkPolicies as the operator builds them: selectors, ports, owner, and
when they are made; the operator's identity as the chart hands it over."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from elasticjob_operator import models, network_policy
from elasticjob_operator.builders import JobRef
from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.network_policy import OperatorPeer, peer_from_env
from elasticjob_operator.observe import Observed
from elasticjob_operator.reconcile import Config, reconcile, shared_etcd_of

REF = JobRef(name="train", namespace="ml", uid="uid-1")
OPERATOR = OperatorPeer(
    "ops", (("app.kubernetes.io/instance", "rel"), ("app.kubernetes.io/name", "op"))
)
WORKERS = {"elastic.pytorch.org/job-name": "train", "elastic.pytorch.org/replica-type": "worker"}
ETCD = {"elastic.pytorch.org/job-name": "train", "elastic.pytorch.org/replica-type": "etcd"}


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


def test_workers_accept_connections_from_their_own_job_only_on_every_port() -> None:
    policy = network_policy.worker_policy(REF)
    assert policy["kind"] == "NetworkPolicy"
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["name"] == "train-worker"
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"] == [REF.owner_reference()]
    assert policy["spec"] == {
        "podSelector": {"matchLabels": WORKERS},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": WORKERS}}]}],
    }


def test_etcd_accepts_its_workers_and_the_operators_pods_on_the_client_port() -> None:
    policy = network_policy.etcd_policy(REF, OPERATOR)
    assert policy["metadata"]["name"] == "train-etcd"
    assert policy["metadata"]["labels"]["elastic.pytorch.org/job-name"] == "train"
    assert policy["spec"] == {
        "podSelector": {"matchLabels": ETCD},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [
                    {"podSelector": {"matchLabels": WORKERS}},
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "ops"}
                        },
                        "podSelector": {
                            "matchLabels": {
                                "app.kubernetes.io/instance": "rel",
                                "app.kubernetes.io/name": "op",
                            }
                        },
                    },
                ],
                "ports": [{"protocol": "TCP", "port": 2379}],
            }
        ],
    }


def _policies_created(spec: models.ElasticJobSpec, config: Config) -> list[str]:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    shared = shared_etcd_of(REF, spec, Observed(), config)
    d = reconcile(REF, 1, spec, models.ElasticJobStatus(), Observed(), now, config, shared)
    return [o["metadata"]["name"] for o in d.create if o["kind"] == "NetworkPolicy"]


def test_no_etcd_policy_unless_the_operator_runs_an_etcd_for_the_job_alone() -> None:
    on = Config(network_policy=OPERATOR)
    assert _policies_created(make_spec(), on) == ["train-worker", "train-etcd"]
    for spec in (make_spec(rdzvEndpoint="etcd:2379"), make_spec(rdzvBackend="c10d")):
        assert _policies_created(spec, on) == ["train-worker"]
    # the shared etcd's policy is the chart's
    shared = replace(on, shared_etcd=SharedEtcd("ops", "elasticjob-etcd", "elasticjob-etcd-tls"))
    assert _policies_created(make_spec(), shared) == ["train-worker"]


def test_reconcile_creates_missing_policies_before_anything_else_and_only_when_on() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    status = models.ElasticJobStatus()
    on = Config(network_policy=OPERATOR)
    first = reconcile(REF, 1, make_spec(), status, Observed(), now, on)
    kinds = [o["kind"] for o in first.create]
    assert kinds[:2] == ["NetworkPolicy", "NetworkPolicy"]
    assert "NetworkPolicy" not in kinds[2:]
    there = Observed(network_policies=frozenset({"train-worker", "train-etcd"}))
    again = reconcile(REF, 1, make_spec(), status, there, now, on)
    assert "NetworkPolicy" not in [o["kind"] for o in again.create]
    off = reconcile(REF, 1, make_spec(), status, Observed(), now, Config())
    assert "NetworkPolicy" not in [o["kind"] for o in off.create]


def test_the_operator_learns_who_it_is_from_the_charts_environment() -> None:
    env = {
        "ELASTICJOB_OPERATOR_NAMESPACE": "ops",
        "ELASTICJOB_OPERATOR_LABELS": "app.kubernetes.io/name=op,app.kubernetes.io/instance=rel",
    }
    assert peer_from_env(env) == OPERATOR  # on by default
    assert peer_from_env({**env, "ELASTICJOB_NETWORK_POLICY": "true"}) == OPERATOR
    assert peer_from_env({**env, "ELASTICJOB_NETWORK_POLICY": "false"}) is None
    assert peer_from_env({"ELASTICJOB_NETWORK_POLICY": "false"}) is None


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "set ELASTICJOB_OPERATOR_NAMESPACE"),
        ({"ELASTICJOB_OPERATOR_NAMESPACE": "ops"}, "ELASTICJOB_OPERATOR_LABELS"),
        (
            {"ELASTICJOB_OPERATOR_NAMESPACE": "ops", "ELASTICJOB_OPERATOR_LABELS": "a"},
            "'a' is not key=value",
        ),
        ({"ELASTICJOB_NETWORK_POLICY": "maybe"}, "set it to true or false"),
    ],
)
def test_a_missing_or_bad_identity_is_one_clear_line(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        peer_from_env(env)
