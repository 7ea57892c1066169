"""Every pending claim gets a pre-bound hostPath volume; released ones are deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticjob_devcluster.provisioner import (
    PROVISIONED_BY,
    pv_manifest,
    pv_name,
    released,
    wants_volume,
)


def claim(phase: str = "Pending", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "ckpt", "namespace": "ns", "uid": "u1"},
        "spec": spec,
        "status": {"phase": phase},
    }


def test_only_a_pending_unbound_claim_without_its_volume_wants_one() -> None:
    assert wants_volume(claim(), lambda name: False)
    assert not wants_volume(claim(), lambda name: name == "pvc-u1")
    assert not wants_volume(claim("Bound"), lambda name: False)
    assert not wants_volume(claim(volumeName="pv-x"), lambda name: False)


def test_the_volume_is_the_claims_directory_bound_to_exactly_that_claim() -> None:
    pvc = claim(
        accessModes=["ReadWriteMany"],
        storageClassName="fast",
        resources={"requests": {"storage": "5Gi"}},
    )
    pv = pv_manifest(pvc, Path("/shared/pvc/ns/ckpt"))
    assert pv["metadata"] == {"name": pv_name(pvc), "labels": {PROVISIONED_BY: "true"}}
    spec = pv["spec"]
    assert spec["capacity"] == {"storage": "5Gi"}
    assert spec["accessModes"] == ["ReadWriteMany"]
    assert spec["storageClassName"] == "fast"
    assert spec["hostPath"] == {"path": "/shared/pvc/ns/ckpt", "type": "DirectoryOrCreate"}
    assert spec["claimRef"]["uid"] == "u1" and spec["claimRef"]["name"] == "ckpt"


def test_a_claim_without_size_or_modes_gets_the_defaults() -> None:
    spec = pv_manifest(claim(), Path("/p"))["spec"]
    assert spec["capacity"] == {"storage": "1Gi"}
    assert spec["accessModes"] == ["ReadWriteOnce"]
    assert spec["volumeMode"] == "Filesystem"


def test_only_released_volumes_this_provisioner_made_are_deleted() -> None:
    ours = {"metadata": {"name": "a", "labels": {PROVISIONED_BY: "true"}}}
    assert released({**ours, "status": {"phase": "Released"}})
    assert not released({**ours, "status": {"phase": "Bound"}})
    assert not released({"metadata": {"name": "b"}, "status": {"phase": "Released"}})
