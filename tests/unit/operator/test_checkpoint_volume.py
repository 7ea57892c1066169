"""The Warning a job gets when its checkpoints would go with its pods (checkpoint_volume.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticjob_operator.checkpoint_volume import REASON, durability_warning, not_durable
from elasticjob_operator.models import ElasticJob, PodSpec

MANIFESTS = Path(__file__).resolve().parents[3] / "examples" / "manifests"


def pod(env: str | None, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> PodSpec:
    container: dict[str, Any] = {"name": "trainer", "image": "x", "volumeMounts": mounts}
    if env is not None:
        container["env"] = [{"name": "ELASTICJOB_CHECKPOINT_DIR", "value": env}]
    return PodSpec.model_validate({"containers": [container], "volumes": volumes})


CLAIM = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}
EMPTY = {"name": "ckpt", "emptyDir": {}}


@pytest.mark.parametrize(
    ("env", "mounts", "volumes", "says"),
    [
        ("/checkpoints", [{"name": "ckpt", "mountPath": "/checkpoints"}], [CLAIM], None),
        ("/data/ckpt/run1", [{"name": "ckpt", "mountPath": "/data"}], [CLAIM], None),
        ("/checkpoints", [{"name": "ckpt", "mountPath": "/checkpoints"}], [EMPTY], "emptyDir"),
        ("/checkpoints", [], [], "is on no volume"),
        ("/checkpointsX", [{"name": "ckpt", "mountPath": "/checkpoints"}], [CLAIM], "no volume"),
        (None, [], [], "sets no ELASTICJOB_CHECKPOINT_DIR and mounts no volume"),
        (None, [{"name": "ckpt", "mountPath": "/data"}], [CLAIM], None),  # its own flag, maybe
    ],
)
def test_checkpoints_that_would_go_with_the_pod_are_named(
    env: str | None, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]], says: str | None
) -> None:
    why = not_durable(pod(env, mounts, volumes))
    if says is None:
        assert why is None
    else:
        assert why is not None and says in why and "PersistentVolumeClaim" in why, why


def test_the_deepest_mount_decides() -> None:
    mounts = [{"name": "root", "mountPath": "/"}, {"name": "ckpt", "mountPath": "/ckpt"}]
    volumes = [{"name": "root", "emptyDir": {}}, CLAIM]
    assert not_durable(pod("/ckpt/job", mounts, volumes)) is None


def test_the_warning_is_posted_with_the_worker_service() -> None:
    event = durability_warning(pod("/checkpoints", [], []), ("Service/w",))
    assert event is not None and event.type == "Warning" and event.reason == REASON
    assert event.reports == ("Service/w",)


@pytest.mark.parametrize(
    ("name", "durable"),
    [("fsdp.yaml", True), ("gpu.yaml", True), ("elastic.yaml", False)],
)
def test_the_example_manifests_say_what_they_are(name: str, durable: bool) -> None:
    (doc,) = [
        d
        for d in yaml.safe_load_all((MANIFESTS / name).read_text())
        if d and d["kind"] == "ElasticJob"
    ]
    spec = ElasticJob.model_validate(doc).spec.worker.template.spec
    assert (not_durable(spec) is None) == durable
