"""A pod's volumes on this node: fetched, written out, refreshed, and mounted.

volumes.py writes each volume from the objects it refers to; this fetches those
ConfigMaps and Secrets, asks the API server for the service-account tokens projected
volumes carry (refreshed at 80 % of their hour, as kubelet does), and says what each
container bind-mounts where (Mounts of its ContainerSpec).
"""

from __future__ import annotations

import time
from pathlib import Path

from elasticjob_devcluster import volumes
from elasticjob_devcluster.container_spec import Mount
from elasticjob_devcluster.kubeapi import TIMEOUT, ApiException, Obj, body, raw
from elasticjob_devcluster.node_context import NodeContext
from elasticjob_devcluster.pod_env import EnvError, referenced_objects
from elasticjob_devcluster.pod_runtime import PodRuntime

TOKEN_REFRESH_S = 0.8 * 3600
ROOT_CA = "kube-root-ca.crt"  # the ConfigMap every namespace has; we know its content
READ_ONLY_KINDS = ("configMap", "secret", "projected", "downwardAPI")


def fetch(ctx: NodeContext, kind: str, namespace: str, names: set[str]) -> dict[str, Obj]:
    """The named ConfigMaps ("configmap") or Secrets of a namespace that exist."""
    fn = (
        ctx.core.read_namespaced_config_map
        if kind == "configmap"
        else ctx.core.read_namespaced_secret
    )
    out: dict[str, Obj] = {}
    for name in names:
        try:
            out[name] = raw(fn(name, namespace, _preload_content=False, _request_timeout=TIMEOUT))
        except ApiException as e:
            if e.status != 404:
                raise
    if kind == "configmap" and ROOT_CA in names and ROOT_CA not in out:
        out[ROOT_CA] = {"data": {"ca.crt": ctx.ca_pem}}
    return out


def referenced(ctx: NodeContext, rt: PodRuntime) -> tuple[dict[str, Obj], dict[str, Obj]]:
    """The ConfigMaps and Secrets the pod's env and volumes refer to."""
    cm_names, secret_names = referenced_objects(rt.pod)
    return (
        fetch(ctx, "configmap", rt.namespace, cm_names),
        fetch(ctx, "secret", rt.namespace, secret_names),
    )


def prepare(ctx: NodeContext, rt: PodRuntime, cms: dict[str, Obj], secrets: dict[str, Obj]) -> None:
    for vol in rt.spec.get("volumes") or []:
        volumes.materialise(
            vol,
            rt.volume_dir(vol["name"]),
            rt.pod,
            cms,
            secrets,
            pvc_root=ctx.claims_dir(rt.namespace),
            token=lambda aud, secs: request_token(ctx, rt, aud, secs),
        )
    rt.volumes_ready = True
    rt.token_refresh_at = time.time() + TOKEN_REFRESH_S


def request_token(ctx: NodeContext, rt: PodRuntime, audience: str | None, seconds: int) -> str:
    """A service-account token bound to the pod (a TokenRequest, as kubelet makes)."""
    sa = rt.spec.get("serviceAccountName") or "default"
    request: Obj = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": rt.name, "uid": rt.uid},
        },
    }
    if audience:
        request["spec"]["audiences"] = [audience]
    resp = raw(
        ctx.core.create_namespaced_service_account_token(
            sa, rt.namespace, body(request), _preload_content=False, _request_timeout=TIMEOUT
        )
    )
    token: str = resp["status"]["token"]
    return token


def refresh_tokens(ctx: NodeContext, rt: PodRuntime, now: float) -> None:
    if rt.volumes_ready and now >= rt.token_refresh_at:
        rt.volumes_ready = False  # the next container start (or now) rewrites them
        cms, secrets = referenced(ctx, rt)
        prepare(ctx, rt, cms, secrets)


def mount_source(vol: Obj, volume_mount: Obj, volume_dir: Path, claims_dir: Path) -> Path:
    """The host path a volumeMount binds: the volume's directory, the hostPath itself,
    or the claim's shared directory, then its subPath."""
    source = volume_dir
    if vol.get("hostPath"):
        source = Path(vol["hostPath"]["path"])
    elif vol.get("persistentVolumeClaim"):
        source = claims_dir / vol["persistentVolumeClaim"]["claimName"]
    if volume_mount.get("subPath"):
        source = source / volume_mount["subPath"]
    return source


def container_mounts(ctx: NodeContext, rt: PodRuntime, c: Obj) -> list[Mount]:
    """What container `c` mounts: the pod's /dev/shm (unless it brings its own), then
    its volumeMounts (subPath directories created when missing, as kubelet does)."""
    by_name = {v["name"]: v for v in rt.spec.get("volumes") or []}
    out: list[Mount] = []
    if not rt.spec.get("hostIPC") and not volumes.mounts_shm(c):
        out.append(Mount(str(rt.shm_dir), volumes.SHM_PATH))
    for vm in c.get("volumeMounts") or []:
        vol = by_name.get(vm["name"])
        if vol is None:
            raise EnvError(f"volumeMount {vm['name']!r} names no volume of the pod")
        source = mount_source(vol, vm, rt.volume_dir(vm["name"]), ctx.claims_dir(rt.namespace))
        if vm.get("subPath") and not source.exists():
            source.mkdir(parents=True, exist_ok=True)
        read_only = bool(vm.get("readOnly")) or any(k in vol for k in READ_ONLY_KINDS)
        out.append(Mount(str(source), vm["mountPath"], read_only))
    return out
