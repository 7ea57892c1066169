"""What a round decides beyond children and events: the job's etcd credentials as the
plan's first step, and the status it writes when its children are created (the I/O layer
edits no status)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from elasticjob_operator import models
from elasticjob_operator.builders import JobRef
from elasticjob_operator.conditions import set_condition
from elasticjob_operator.decision import Credentials
from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.models import ConditionType as C
from elasticjob_operator.observe import Observed
from elasticjob_operator.reconcile import Config, reconcile, shared_etcd_of

NOW = datetime(2026, 11, 23, 12, 0, 0, 123456, tzinfo=UTC)
REF = JobRef(name="train", namespace="ml", uid=str(uuid.UUID(int=1)))
SHARED = SharedEtcd("ops", "etcd", "etcd-tls")


def spec(**over: Any) -> models.ElasticJobSpec:
    raw: dict[str, Any] = {
        "replicaSpecs": {
            "Worker": {
                "replicas": 2,
                "template": {"spec": {"containers": [{"name": "t", "image": "img"}]}},
            }
        },
        **over,
    }
    return models.ElasticJobSpec.model_validate(raw)


def test_a_provisioned_etcd_makes_its_credentials_the_first_step() -> None:
    d = reconcile(REF, 1, spec(), models.ElasticJobStatus(), Observed(), NOW)
    assert d.credentials == Credentials(recheck=True, shared=False)  # pods mount them


def test_the_shared_etcd_is_chosen_once_and_named_in_the_credentials() -> None:
    config = Config(shared_etcd=SHARED)
    shared = shared_etcd_of(REF, spec(), Observed(), config)
    d = reconcile(REF, 1, spec(), models.ElasticJobStatus(), Observed(), NOW, config, shared)
    assert d.credentials == Credentials(recheck=True, shared=True)


def test_no_credentials_for_an_etcd_the_job_brings_or_a_finished_job() -> None:
    d = reconcile(
        REF, 1, spec(rdzvEndpoint="etcd:2379"), models.ElasticJobStatus(), Observed(), NOW
    )
    assert d.credentials is None
    done = models.ElasticJobStatus()
    set_condition(done, C.SUCCEEDED, True, "Done", "done", NOW)
    assert reconcile(REF, 1, spec(), done, Observed(), NOW).credentials is None


def test_creating_the_children_turns_replica_failure_false_in_the_decided_status() -> None:
    refused = models.ElasticJobStatus()
    set_condition(refused, C.REPLICA_FAILURE, True, "FailedCreate", "forbidden", NOW)
    d = reconcile(REF, 1, spec(), refused, Observed(), NOW)
    assert d.create
    condition = next(c for c in d.status.conditions if c.type == C.REPLICA_FAILURE)
    assert condition.status == "False" and condition.reason == "Created"
    assert condition.last_transition_time == NOW.replace(microsecond=0)  # the round's clock
