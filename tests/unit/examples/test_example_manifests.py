"""The example manifests are valid ElasticJobs and their pods' commands resolve.

Each YAML is parsed by the operator's pydantic model (the CRD's source of truth, with
the same cross-field rules the API server enforces), so a manifest that drifts from
the API fails here rather than at `kubectl apply`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticjob_operator.models import ElasticJob, RdzvBackend, RestartPolicy

MANIFESTS = Path(__file__).resolve().parents[3] / "examples" / "manifests"
NAMES = sorted(p.name for p in MANIFESTS.glob("*.yaml"))


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def load(name: str) -> tuple[dict[str, Any], ElasticJob]:
    """The file's ElasticJob (a file may bring the objects it needs, e.g. Kueue's)."""
    (doc,) = [d for d in documents(name) if d.get("kind") == "ElasticJob"]
    return doc, ElasticJob.model_validate(doc)


def test_the_issue_asks_for_these_manifests() -> None:
    assert set(NAMES) >= {
        "elastic.yaml",
        "fixed-size.yaml",
        "external-etcd.yaml",
        "c10d.yaml",
        "torchelastic-classic.yaml",
        "kueue.yaml",
        "fsdp.yaml",
    }


@pytest.mark.parametrize("name", NAMES)
def test_every_manifest_parses_as_an_elasticjob(name: str) -> None:
    doc, job = load(name)
    assert doc["apiVersion"] == "elastic.pytorch.org/v1alpha1" and doc["kind"] == "ElasticJob"
    assert job.metadata["name"]
    spec = job.spec
    assert spec.min_replicas <= spec.desired_replicas <= spec.effective_max_replicas


@pytest.mark.parametrize("name", NAMES)
def test_every_trainer_runs_an_installed_example_module(name: str) -> None:
    _, job = load(name)
    trainer = job.spec.worker.template.spec.containers[0]
    argv = [*(trainer.command or []), *(trainer.model_extra or {}).get("args", [])]
    assert argv[0] == "elasticjob-run", argv
    module = argv[argv.index("-m") + 1]
    assert module.startswith("elasticjob_examples.")
    assert importlib.util.find_spec(module) is not None, f"{name}: {module} is not importable"


@pytest.mark.parametrize("name", NAMES)
def test_train_variables_in_manifests_are_ones_the_example_reads(name: str) -> None:
    from elasticjob_examples.train_regression import OPTIONS

    known = {env for _, env, *_ in OPTIONS}
    _, job = load(name)
    trainer = job.spec.worker.template.spec.containers[0]
    env = [e.name for e in trainer.env or []]
    unknown = [n for n in env if n.startswith("TRAIN_") and n not in known]
    assert not unknown, f"{name} sets variables the example ignores: {unknown}"


def test_the_fsdp_manifest_checkpoints_on_one_claim_every_worker_can_read() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents("fsdp.yaml")}
    _, job = load("fsdp.yaml")
    trainer = job.spec.worker.template.spec.containers[0]
    assert "elasticjob_examples.train_gpt_fsdp" in (trainer.model_extra or {})["args"]
    env = {e.name: e.value for e in trainer.env or []}
    mounts = {m["name"]: m["mountPath"] for m in trainer.volume_mounts or []}
    assert env["ELASTICJOB_CHECKPOINT_DIR"] == mounts["checkpoints"]
    volumes = job.spec.worker.template.spec.volumes or []
    claim = next(v for v in volumes if v["name"] == "checkpoints")["persistentVolumeClaim"]
    pvc = docs[("PersistentVolumeClaim", claim["claimName"])]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # a restore reads every rank's
    assert job.spec.min_replicas < job.spec.desired_replicas < job.spec.effective_max_replicas


def test_elastic_manifest_scales_between_one_and_four_with_a_provisioned_etcd() -> None:
    _, job = load("elastic.yaml")
    assert (job.spec.min_replicas, job.spec.effective_max_replicas) == (1, 4)
    assert job.spec.provisions_etcd


def test_fixed_size_manifest_neither_grows_nor_shrinks() -> None:
    _, job = load("fixed-size.yaml")
    spec = job.spec
    assert spec.min_replicas == spec.effective_max_replicas == spec.desired_replicas == 3


def test_external_etcd_manifest_provisions_nothing() -> None:
    _, job = load("external-etcd.yaml")
    assert job.spec.rdzv_endpoint and not job.spec.provisions_etcd
    assert job.spec.rdzv_backend is RdzvBackend.ETCD_V3


def test_c10d_manifest_uses_torchs_store() -> None:
    _, job = load("c10d.yaml")
    assert job.spec.rdzv_backend is RdzvBackend.C10D and not job.spec.provisions_etcd


def test_classic_manifest_has_the_archived_controllers_shape() -> None:
    doc, job = load("torchelastic-classic.yaml")
    assert set(doc["spec"]) == {"rdzvEndpoint", "minReplicas", "maxReplicas", "replicaSpecs"}
    worker = doc["spec"]["replicaSpecs"]["Worker"]
    assert set(worker) == {"replicas", "restartPolicy", "template"}
    assert worker["template"]["kind"] == "Pod"
    assert job.spec.worker.restart_policy is RestartPolicy.EXIT_CODE


def cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_the_kueue_manifest_queues_its_job_on_a_quota_that_admits_its_minimum() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents("kueue.yaml")}
    doc, job = load("kueue.yaml")
    queue = doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    local = docs[("LocalQueue", queue)]
    assert local["metadata"]["namespace"] == doc["metadata"]["namespace"]
    cluster_queue = docs[("ClusterQueue", local["spec"]["clusterQueue"])]
    assert cluster_queue["spec"]["namespaceSelector"] == {}  # null would admit no namespace
    (group,) = cluster_queue["spec"]["resourceGroups"]
    (flavor,) = group["flavors"]
    assert ("ResourceFlavor", flavor["name"]) in docs
    quota = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
    trainer = job.spec.worker.template.spec.containers[0]
    per_worker = cores((trainer.model_extra or {})["resources"]["requests"]["cpu"])
    admitted = int(cores(quota["cpu"]) // per_worker)
    assert job.spec.min_replicas <= admitted < job.spec.desired_replicas, (
        "the example should show a partial admission"
    )
    volumes = job.spec.worker.template.spec.volumes or []
    claim = next(v for v in volumes if v["name"] == "checkpoints")["persistentVolumeClaim"]
    assert ("PersistentVolumeClaim", claim["claimName"]) in docs


def test_the_gpu_manifest_runs_one_worker_per_gpu_it_asks_for() -> None:
    _, job = load("gpu.yaml")
    assert job.spec.nproc_per_node == "gpu"  # elasticjob-run starts one per visible GPU
    trainer = job.spec.worker.template.spec.containers[0]
    limits = (trainer.model_extra or {})["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    args = (trainer.model_extra or {})["args"]
    from elasticjob_examples.train_gpt import parse_args

    parsed = parse_args(args[args.index("-m") + 2 :])  # every flag is one the script takes
    assert parsed.backend in ("gloo", "nccl")
