"""Where each volumeMount's files come from on the host."""

from __future__ import annotations

from pathlib import Path

from elasticjob_devcluster.pod_volumes import mount_source

VOL_DIR = Path("/pods/u/volumes/data")
CLAIMS = Path("/shared/pvc/ns")


def test_a_volume_is_its_own_directory_and_a_host_path_is_itself() -> None:
    assert mount_source({"emptyDir": {}}, {}, VOL_DIR, CLAIMS) == VOL_DIR
    host = {"hostPath": {"path": "/data/x"}}
    assert mount_source(host, {}, VOL_DIR, CLAIMS) == Path("/data/x")


def test_a_claim_is_its_shared_directory_and_sub_path_goes_below() -> None:
    claim = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    assert mount_source(claim, {}, VOL_DIR, CLAIMS) == CLAIMS / "ckpt"
    assert mount_source(claim, {"subPath": "run-1"}, VOL_DIR, CLAIMS) == CLAIMS / "ckpt/run-1"
