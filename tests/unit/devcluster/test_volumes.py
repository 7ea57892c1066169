"""Volumes appear as the files a pod expects at its mountPaths."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest

from elasticjob_devcluster.volumes import (
    VolumeError,
    materialise,
    memory_size,
    mounts_shm,
    mounts_under,
    pod_tmpfs_mounts,
)

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


def test_memory_empty_dir_size_is_its_size_limit_in_bytes() -> None:
    def vol(**empty: str) -> dict:
        return {"name": "m", "emptyDir": empty}

    assert memory_size(vol(medium="Memory", sizeLimit="2Gi")) == 2 * 1024**3
    assert memory_size(vol(medium="Memory", sizeLimit="1.5M")) == 1_500_000
    assert memory_size(vol(medium="Memory")) == 0  # no limit: tmpfs's own default
    assert memory_size(vol(medium="Memory", sizeLimit="0")) == 0  # kubelet: no limit either
    assert memory_size(vol()) is None  # on disk: a plain directory
    assert memory_size({"name": "h", "hostPath": {"path": "/x"}}) is None
    with pytest.raises(VolumeError, match="'m': sizeLimit '-1Mi' must not be negative"):
        memory_size(vol(medium="Memory", sizeLimit="-1Mi"))
    with pytest.raises(VolumeError, match="'m': sizeLimit 'lots'"):
        memory_size(vol(medium="Memory", sizeLimit="lots"))


def test_a_container_mounting_dev_shm_is_recognised() -> None:
    assert mounts_shm({"volumeMounts": [{"name": "d", "mountPath": "/dev/shm/"}]})
    assert not mounts_shm({"volumeMounts": [{"name": "d", "mountPath": "/dev/shmem"}]})
    assert not mounts_shm({"name": "c"})


def test_mounts_inside_a_pods_directory_are_found_deepest_first(tmp_path: Path) -> None:
    pods = tmp_path / "node a" / "pods"
    esc = str(pods).replace(" ", "\\040")
    mountinfo = "\n".join(
        [
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
            f"90 22 0:50 / {esc}/u1/shm rw - tmpfs tmpfs rw,size=65536k",
            f"91 22 0:51 / {esc}/u1/volumes/dshm rw - tmpfs tmpfs rw,size=8192k",
            f"92 91 0:52 / {esc}/u1/volumes/dshm/inner rw - tmpfs tmpfs rw",
            f"93 22 0:53 / {esc}-other/u9/shm rw - tmpfs tmpfs rw",  # a sibling, not inside
            f"94 22 0:54 / {esc} rw - tmpfs tmpfs rw",  # the root itself stays
        ]
    )
    assert mounts_under(pods, mountinfo) == [
        pods / "u1/volumes/dshm/inner",
        pods / "u1/volumes/dshm",
        pods / "u1/shm",
    ]


def test_a_container_finds_the_pod_tmpfs_copies_it_inherited() -> None:
    mountinfo = "\n".join(
        [
            "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
            "30 22 0:20 / /dev/shm rw shared:5 - tmpfs tmpfs rw",  # the host's own
            "90 22 0:50 / /c1/nodes/n1/pods/u1/shm rw - tmpfs devcluster-pod rw,size=65536k",
            "91 22 0:51 / /c2/nodes/n/pods/u2/volumes/d rw master:3 - tmpfs devcluster-pod rw",
            "95 22 0:50 / /dev/shm rw - tmpfs devcluster-pod rw,size=65536k",
        ]
    )
    assert pod_tmpfs_mounts(mountinfo) == [
        Path("/c2/nodes/n/pods/u2/volumes/d"),
        Path("/c1/nodes/n1/pods/u1/shm"),
        Path("/dev/shm"),
    ]
