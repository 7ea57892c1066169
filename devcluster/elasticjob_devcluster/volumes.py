"""Pod volumes as directories the container_init bind-mounts at each mountPath.

emptyDir: a fresh directory per pod. hostPath: the host path itself (created for
"", DirectoryOrCreate, FileOrCreate). persistentVolumeClaim: one directory per claim
under the cluster's shared dir, so every pod mounting the claim (on any node) sees the
same files. configMap, secret, downwardAPI and projected (including the service-account
token the ServiceAccount admission plugin injects) are written out as files.
Files are written atomically (temp + rename) so a refreshed token never reads torn.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
TokenFn = Callable[[str | None, int], str]


class VolumeError(Exception):
    pass


def write_file(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    tmp.replace(path)


def _items(
    data: Mapping[str, bytes], items: list[Obj] | None, default_mode: int
) -> list[tuple[str, bytes, int]]:
    if not items:
        return [(k, v, default_mode) for k, v in sorted(data.items())]
    out = []
    for it in items:
        if it["key"] not in data:
            raise VolumeError(f"key {it['key']!r} not found")
        out.append((it["path"], data[it["key"]], int(it.get("mode") or default_mode)))
    return out


def _cm_data(cm: Obj) -> dict[str, bytes]:
    data = {k: str(v).encode() for k, v in (cm.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return data


def _secret_data(secret: Obj) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def _downward(pod: Obj, items: list[Obj]) -> list[tuple[str, bytes, int]]:
    from elasticjob_devcluster.pod_env import PodContext, field_value

    ctx = PodContext(str((pod.get("status") or {}).get("podIP") or ""), "127.0.0.1", {})
    out = []
    for it in items:
        if it.get("fieldRef"):
            value = field_value(pod, it["fieldRef"]["fieldPath"], ctx)
            out.append((it["path"], value.encode(), int(it.get("mode") or 0o644)))
    return out


def _source_files(
    src: Obj,
    pod: Obj,
    cms: Mapping[str, Obj],
    secrets: Mapping[str, Obj],
    token: TokenFn,
    default_mode: int,
) -> list[tuple[str, bytes, int]]:
    if src.get("configMap") is not None:
        ref = src["configMap"]
        cm = cms.get(ref["name"])
        if cm is None:
            if ref.get("optional"):
                return []
            raise VolumeError(f'configmap "{ref["name"]}" not found')
        return _items(_cm_data(cm), ref.get("items"), int(ref.get("defaultMode") or default_mode))
    if src.get("secret") is not None:
        ref = src["secret"]
        name = ref.get("secretName") or ref.get("name")
        secret = secrets.get(name)
        if secret is None:
            if ref.get("optional"):
                return []
            raise VolumeError(f'secret "{name}" not found')
        mode = int(ref.get("defaultMode") or default_mode)
        return _items(_secret_data(secret), ref.get("items"), mode)
    if src.get("downwardAPI") is not None:
        return _downward(pod, src["downwardAPI"].get("items") or [])
    if src.get("serviceAccountToken") is not None:
        ref = src["serviceAccountToken"]
        tok = token(ref.get("audience"), int(ref.get("expirationSeconds") or 3600))
        return [(ref.get("path") or "token", tok.encode(), default_mode)]
    return []


def materialise(
    vol: Obj,
    target: Path,
    pod: Obj,
    cms: Mapping[str, Obj],
    secrets: Mapping[str, Obj],
    *,
    pvc_root: Path,
    token: TokenFn,
) -> None:
    """Create or refresh one volume's directory (or, for hostPath/PVC, its real path)."""
    if vol.get("hostPath") is not None:
        hp = vol["hostPath"]
        path = Path(hp["path"])
        kind = hp.get("type") or ""
        if kind in ("", "DirectoryOrCreate") and not path.exists():
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate" and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        elif not path.exists():
            raise VolumeError(f"hostPath {path} does not exist (type {kind})")
        return
    if vol.get("persistentVolumeClaim") is not None:
        (pvc_root / vol["persistentVolumeClaim"]["claimName"]).mkdir(parents=True, exist_ok=True)
        return
    target.mkdir(parents=True, exist_ok=True)
    if vol.get("emptyDir") is not None:
        return
    files: list[tuple[str, bytes, int]] = []
    if vol.get("projected") is not None:
        mode = int(vol["projected"].get("defaultMode") or 0o644)
        for src in vol["projected"].get("sources") or []:
            files += _source_files(src, pod, cms, secrets, token, mode)
    elif any(k in vol for k in ("configMap", "secret", "downwardAPI")):
        files = _source_files(vol, pod, cms, secrets, token, 0o644)
    else:
        kinds = sorted(k for k in vol if k != "name")
        raise VolumeError(f"volume {vol['name']!r}: unsupported kind {kinds}")
    for rel, data, mode in files:
        write_file(target / rel, data, mode)
