"""A volume provisioner for every StorageClass: each claim gets a directory.

Each Pending PersistentVolumeClaim gets a hostPath PV on its directory in the
cluster's shared dir (the one pods on every node mount), pre-bound to the claim so
the controller-manager's PV controller binds them. A Released PV made here is
deleted with its directory (reclaim policy Delete, done by hand since hostPath has no
deleter). Only the leader node's agent runs it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from elasticjob_devcluster.informers import Cache
from elasticjob_devcluster.kubeapi import TIMEOUT, ApiException, Obj, body
from elasticjob_devcluster.node_context import NodeContext

log = logging.getLogger("elasticjob_devcluster.provisioner")

PROVISIONED_BY = "devcluster.elasticjob.dev/provisioned"


def pv_name(pvc: Obj) -> str:
    return f"pvc-{pvc['metadata']['uid']}"


def wants_volume(pvc: Obj, pv_exists: Callable[[str], bool]) -> bool:
    """A Pending claim not bound to a volume, whose PV has not been made yet."""
    spec = pvc.get("spec") or {}
    if spec.get("volumeName") or (pvc.get("status") or {}).get("phase") != "Pending":
        return False
    return not pv_exists(pv_name(pvc))


def pv_manifest(pvc: Obj, path: Path) -> Obj:
    """A hostPath PV on `path` of the claim's size, access modes and class, bound to it."""
    m, spec = pvc["metadata"], pvc.get("spec") or {}
    size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv_name(pvc), "labels": {PROVISIONED_BY: "true"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "storageClassName": spec.get("storageClassName") or "",
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": m["namespace"],
                "name": m["name"],
                "uid": m["uid"],
            },
        },
    }


def released(pv: Obj) -> bool:
    """A PV this provisioner made whose claim is gone."""
    labels = pv["metadata"].get("labels") or {}
    return bool(labels.get(PROVISIONED_BY)) and (pv.get("status") or {}).get("phase") == "Released"


def provision(ctx: NodeContext, cache: Cache) -> None:
    for pvc in cache.items("pvcs"):
        if not wants_volume(pvc, lambda name: cache.get("pvs", f"/{name}") is not None):
            continue
        m = pvc["metadata"]
        path = ctx.claims_dir(m["namespace"]) / m["name"]
        path.mkdir(parents=True, exist_ok=True)
        name = pv_name(pvc)
        try:
            ctx.core.create_persistent_volume(
                body(pv_manifest(pvc, path)), _preload_content=False, _request_timeout=TIMEOUT
            )
            log.info("provisioned %s for %s/%s", name, m["namespace"], m["name"])
        except ApiException as e:
            if e.status != 409:
                log.warning("provisioning %s: %s", name, e.reason)
    for pv in cache.items("pvs"):
        if released(pv):
            path = Path(pv["spec"]["hostPath"]["path"])
            if ctx.shared in path.parents:
                shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(ApiException):
                ctx.core.delete_persistent_volume(
                    pv["metadata"]["name"], _preload_content=False, _request_timeout=TIMEOUT
                )
