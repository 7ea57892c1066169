"""The ElasticJob models: what the archived controller's users write parses, defaults are
what the docs say, and every cross-field rule refuses bad input with a message that
names the field and the fix."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from elasticjob_operator import models

ARCHIVED = {
    "apiVersion": "elastic.pytorch.org/v1alpha1",
    "kind": "ElasticJob",
    "metadata": {"name": "imagenet", "namespace": "elastic-job"},
    "spec": {
        "rdzvEndpoint": "etcd-service:2379",
        "minReplicas": 1,
        "maxReplicas": 2,
        "replicaSpecs": {
            "Worker": {
                "replicas": 2,
                "restartPolicy": "ExitCode",
                "template": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "spec": {
                        "containers": [
                            {
                                "name": "elasticjob-worker",
                                "image": "torchelastic/examples:0.2.0",
                                "imagePullPolicy": "Always",
                                "args": ["--nproc_per_node=1", "/workspace/main.py"],
                                "resources": {"limits": {"nvidia.com/gpu": 1}},
                            }
                        ]
                    },
                },
            }
        },
    },
}


def spec(**over: Any) -> dict[str, Any]:
    raw = copy.deepcopy(ARCHIVED["spec"])
    assert isinstance(raw, dict)
    for key, value in over.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def refused(raw: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        models.ElasticJobSpec.model_validate(raw)
    return str(info.value)


def test_archived_controller_manifest_parses_with_our_defaults() -> None:
    job = models.ElasticJob.model_validate(ARCHIVED)
    s = job.spec
    assert s.rdzv_endpoint == "etcd-service:2379"
    assert s.worker.restart_policy is models.RestartPolicy.EXIT_CODE
    assert s.rdzv_backend is models.RdzvBackend.ETCD_V3
    assert s.clean_pod_policy is models.CleanPodPolicy.RUNNING
    assert s.backoff_limit == models.DEFAULT_BACKOFF_LIMIT
    assert s.max_restarts == models.DEFAULT_MAX_RESTARTS
    assert s.suspend is False
    assert not s.provisions_etcd


def test_pod_template_keeps_every_field_it_does_not_model() -> None:
    s = models.ElasticJobSpec.model_validate(spec())
    dumped = s.worker.template.model_dump(mode="json", by_alias=True, exclude_none=True)
    container = dumped["spec"]["containers"][0]
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert dumped["apiVersion"] == "v1"


def test_spec_round_trips_through_json_with_camel_case_names() -> None:
    s = models.ElasticJobSpec.model_validate(spec(ttlSecondsAfterFinished=30, nprocPerNode=2))
    data = s.model_dump(mode="json", exclude_none=True)
    assert data["ttlSecondsAfterFinished"] == 30
    assert data["replicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    assert models.ElasticJobSpec.model_validate(data) == s


def test_effective_sizes_when_fields_are_absent() -> None:
    worker = copy.deepcopy(ARCHIVED["spec"]["replicaSpecs"]["Worker"])  # type: ignore[index]
    del worker["replicas"]
    s = models.ElasticJobSpec.model_validate(
        spec(minReplicas=3, maxReplicas=None, replicaSpecs={"Worker": worker})
    )
    assert (s.desired_replicas, s.effective_max_replicas) == (3, 3)
    s = models.ElasticJobSpec.model_validate(spec(minReplicas=1, maxReplicas=None))
    assert (s.desired_replicas, s.effective_max_replicas) == (2, 2)


@pytest.mark.parametrize(
    ("size", "nbytes"),
    [
        (None, 2 * 1024**3),  # the default, 2Gi
        ("512Mi", 512 * 1024**2),
        ("1.5Gi", 3 * 1024**3 // 2),
        ("8G", 8 * 10**9),
        ("100k", 100_000),
        ("1000", 1000),
        ("0", 0),  # no /dev/shm volume
    ],
)
def test_shm_size_is_a_quantity_of_bytes(size: str | None, nbytes: int) -> None:
    s = models.ElasticJobSpec.model_validate(spec(shmSize=size))
    assert s.shm_size_bytes == nbytes


def test_provisions_etcd_only_for_etcd_v3_without_endpoint() -> None:
    assert models.ElasticJobSpec.model_validate(spec(rdzvEndpoint=None)).provisions_etcd
    c10d = models.ElasticJobSpec.model_validate(spec(rdzvEndpoint=None, rdzvBackend="c10d"))
    assert not c10d.provisions_etcd


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, "spec.minReplicas must not exceed spec.maxReplicas"),
        ({"maxReplicas": 1}, "spec.replicaSpecs.Worker.replicas must not exceed spec.maxReplicas"),
        ({"minReplicas": 3, "maxReplicas": 5}, "replicas must be at least spec.minReplicas"),
        ({"rdzvBackend": "etcd", "rdzvEndpoint": None}, "spec.rdzvBackend etcd needs"),
        ({"etcd": {"image": "x"}}, "spec.etcd configures the etcd the operator provisions"),
        ({"nprocPerNode": 0}, "spec.nprocPerNode must be"),
        ({"nprocPerNode": "many"}, "spec.nprocPerNode must be"),
        ({"rdzvConf": {"a": "1,b=2"}}, "spec.rdzvConf keys must be identifiers"),
        ({"rdzvConf": {"not an id": "1"}}, "spec.rdzvConf keys must be identifiers"),
        ({"rdzvEndpoint": None, "rdzvTLS": {"secretName": "s"}}, "spec.rdzvTLS is for a user's"),
        (
            {"rdzvBackend": "c10d", "rdzvTLS": {"secretName": "s"}},
            "spec.rdzvTLS is for a user's etcd",
        ),
        (
            {"rdzvEndpoint": "http://etcd:2379", "rdzvTLS": {"secretName": "s"}},
            "spec.rdzvTLS is for a user's etcd that serves TLS: it needs spec.rdzvEndpoint "
            "(without http://)",
        ),
        ({"shmSize": "2GB"}, "spec.shmSize must be a quantity of bytes: e.g. 512Mi"),
        ({"shmSize": "-1Gi"}, "spec.shmSize must be a quantity of bytes"),
        ({"shmSize": "lots"}, "spec.shmSize must be a quantity of bytes"),
        ({"shmSize": ""}, "spec.shmSize must be a quantity of bytes"),
    ],
)
def test_cross_field_rules_refuse_with_a_message_naming_the_field(
    over: dict[str, Any], names: str
) -> None:
    assert names in refused(spec(**over))


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"minReplicas": 0}, "minReplicas"),
        ({"backoffLimit": -1}, "backoffLimit"),
        ({"activeDeadlineSeconds": 0}, "activeDeadlineSeconds"),
        ({"rdzvBackend": "zookeeper"}, "rdzvBackend"),
        ({"cleanPodPolicy": "Some"}, "cleanPodPolicy"),
        ({"rdzvEndpoint": "no port"}, "rdzvEndpoint"),
        ({"unknownField": 1}, "unknownField"),
        ({"rdzvTLS": {"secretName": ""}}, "rdzvTLS.secretName"),
        ({"rdzvTLS": {}}, "rdzvTLS.secretName"),
        ({"hangTimeoutSeconds": 9}, "hangTimeoutSeconds"),
        # past index 9999 a longest name's pod hostname is 64 characters, refused
        ({"maxReplicas": 10001}, "maxReplicas"),
        ({"minReplicas": 10001, "maxReplicas": 10001}, "minReplicas"),
        ({"hangTimeoutSeconds": 0}, "hangTimeoutSeconds"),
        ({"hangTimeoutSeconds": 86401}, "hangTimeoutSeconds"),
        ({"hangTimeoutSeconds": "30s"}, "hangTimeoutSeconds"),
    ],
)
def test_bad_single_fields_are_refused_by_name(over: dict[str, Any], field: str) -> None:
    assert field in refused(spec(**over))


def test_rdzv_tls_names_the_secret_for_a_users_etcd() -> None:
    for endpoint in ("etcd-service:2379", "https://etcd-a:2379,https://etcd-b:2379"):
        s = models.ElasticJobSpec.model_validate(
            spec(rdzvEndpoint=endpoint, rdzvTLS={"secretName": "etcd-client"})
        )
        assert s.rdzv_tls is not None and s.rdzv_tls.secret_name == "etcd-client"
        assert s.model_dump(mode="json", exclude_none=True)["rdzvTLS"] == {
            "secretName": "etcd-client"
        }


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("containers.0.env", -2, "env"),
        ("containers.0.env", [{"value": "1"}], "name"),
        ("containers.0.env", ["A=1"], "env"),
        ("containers.0.command", "python train.py", "command"),
        ("containers.0.volumeMounts", {"name": "x"}, "volumeMounts"),
        ("containers.0.ports", [8080], "ports"),
        ("volumes", "shm", "volumes"),
        ("tolerations", {"key": "x"}, "tolerations"),
        ("initContainers", [{"name": "init"}], "image"),
        ("hostIPC", "maybe", "hostIPC"),
    ],
)
def test_template_parts_the_operator_extends_must_have_their_kubernetes_types(
    path: str, value: Any, field: str
) -> None:
    # Found by tests/e2e/test_hostile_input.py: env: -2 passed the CRD and then broke
    # every round of the operator (TypeError building the pod), so the job never ran.
    raw = spec()
    node: Any = raw["replicaSpecs"]["Worker"]["template"]["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    assert field in refused(raw)


def test_template_labels_must_be_strings() -> None:
    raw = spec()
    raw["replicaSpecs"]["Worker"]["template"]["metadata"] = {"labels": ["a"]}
    assert "labels" in refused(raw)


def test_host_ipc_keeps_its_kubernetes_spelling() -> None:
    raw = spec()
    raw["replicaSpecs"]["Worker"]["template"]["spec"]["hostIPC"] = True
    parsed = models.ElasticJobSpec.model_validate(raw)
    dumped = parsed.worker.template.spec.model_dump(mode="json", by_alias=True)
    assert dumped["hostIPC"] is True


def test_nproc_per_node_accepts_numbers_and_torchrun_words() -> None:
    for value in (1, 8, "auto", "gpu", "cpu"):
        assert (
            models.ElasticJobSpec.model_validate(spec(nprocPerNode=value)).nproc_per_node == value
        )


def test_worker_needs_a_container_with_an_image() -> None:
    worker = {"replicas": 1, "template": {"spec": {"containers": []}}}
    assert "containers" in refused(spec(replicaSpecs={"Worker": worker}))
    worker = {"replicas": 1, "template": {"spec": {"containers": [{"name": "t"}]}}}
    assert "image" in refused(spec(replicaSpecs={"Worker": worker}))


def test_every_rule_has_cel_and_a_message_naming_a_spec_field() -> None:
    for rule in models.SPEC_RULES:
        assert rule.cel and rule.field_path.startswith(".")
        assert rule.message.startswith("spec.")
        assert ":" in rule.message  # what is wrong: how to fix it


def test_run_id_is_the_uid_then_suffixed_per_incarnation() -> None:
    assert models.run_id("abc", 0) == "abc"
    assert models.run_id("abc", 2) == "abc-2"


def test_status_round_trips_with_conditions_and_times() -> None:
    raw = {
        "phase": "Running",
        "conditions": [
            {
                "type": "Running",
                "status": "True",
                "reason": "WorkersRunning",
                "message": "2 of 2",
                "lastTransitionTime": "2026-01-01T12:00:00Z",
            }
        ],
        "replicaStatuses": {"Worker": {"active": 2, "succeeded": 0, "failed": 1}},
        "startTime": "2026-01-01T12:00:00Z",
        "restartCount": 1,
        "progress": {"step": 5, "worldSize": 2, "loss": 0.5},
    }
    status = models.ElasticJobStatus.model_validate(raw)
    assert status.is_true(models.ConditionType.RUNNING)
    dumped = status.model_dump(mode="json", exclude_none=True)
    assert dumped["startTime"] == "2026-01-01T12:00:00Z"
    assert dumped["progress"]["loss"] == 0.5
    assert dumped["replicaStatuses"]["Worker"]["failed"] == 1


def test_operator_modules_never_import_torch() -> None:
    code = (
        "import sys\n"
        "import elasticjob_operator.handlers, elasticjob_operator.crd, "
        "elasticjob_operator.etcd.reader, elasticjob_operator.metrics\n"
        "from elasticjob_operator.etcd import reader as etcd_reader\n"
        "etcd_reader.read_run_records('127.0.0.1:1', 'x', timeout=0.2)\n"
        "assert 'torch' not in sys.modules, 'the operator imported torch'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
