"""Volumes appear as the files a pod expects at its mountPaths."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest

from elasticjob_devcluster.volumes import VolumeError, materialise

POD = {"metadata": {"name": "w-0", "namespace": "ml", "uid": "u1", "labels": {"a": "b"}}}
CMS = {
    "cfg": {"data": {"lr": "0.1", "mode": "fast"}},
    "kube-root-ca.crt": {"data": {"ca.crt": "PEM"}},
}
SECRETS = {"sec": {"data": {"pw": base64.b64encode(b"hunter2").decode()}}}


def make(vol: dict, target: Path, pvc_root: Path | None = None) -> None:
    materialise(
        vol,
        target,
        POD,
        CMS,
        SECRETS,
        pvc_root=pvc_root or target.parent / "pvc",
        token=lambda aud, secs: f"token-for-{aud}-{secs}",
    )


def test_config_map_items_and_modes(tmp_path: Path) -> None:
    make(
        {
            "name": "c",
            "configMap": {"name": "cfg", "items": [{"key": "lr", "path": "a/lr", "mode": 0o600}]},
        },
        tmp_path / "c",
    )
    assert (tmp_path / "c/a/lr").read_text() == "0.1" and not (tmp_path / "c/mode").exists()
    assert stat.S_IMODE((tmp_path / "c/a/lr").stat().st_mode) == 0o600


def test_secret_is_decoded_and_missing_optional_source_is_empty(tmp_path: Path) -> None:
    make({"name": "s", "secret": {"secretName": "sec"}}, tmp_path / "s")
    assert (tmp_path / "s/pw").read_bytes() == b"hunter2"
    make({"name": "o", "secret": {"secretName": "nope", "optional": True}}, tmp_path / "o")
    assert list((tmp_path / "o").iterdir()) == []
    with pytest.raises(VolumeError, match="nope"):
        make({"name": "m", "secret": {"secretName": "nope"}}, tmp_path / "m")


def test_projected_service_account_volume(tmp_path: Path) -> None:
    vol = {
        "name": "kube-api-access",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ]
        },
    }
    make(vol, tmp_path / "sa")
    assert (tmp_path / "sa/token").read_text() == "token-for-None-3607"
    assert (tmp_path / "sa/ca.crt").read_text() == "PEM"
    assert (tmp_path / "sa/namespace").read_text() == "ml"


def test_host_path_is_created_and_a_claim_gets_its_shared_directory(tmp_path: Path) -> None:
    make(
        {
            "name": "h",
            "hostPath": {"path": str(tmp_path / "host/dir"), "type": "DirectoryOrCreate"},
        },
        tmp_path / "x",
    )
    assert (tmp_path / "host/dir").is_dir()
    with pytest.raises(VolumeError, match="does not exist"):
        make(
            {"name": "h", "hostPath": {"path": str(tmp_path / "absent"), "type": "Directory"}},
            tmp_path / "y",
        )
    make(
        {"name": "p", "persistentVolumeClaim": {"claimName": "ckpt"}},
        tmp_path / "z",
        tmp_path / "pvc",
    )
    assert (tmp_path / "pvc/ckpt").is_dir()


def test_unsupported_volume_kind_is_named(tmp_path: Path) -> None:
    with pytest.raises(VolumeError, match="nfs"):
        make({"name": "n", "nfs": {"server": "x", "path": "/"}}, tmp_path / "n")
