"""Pod volumes as directories the container_init bind-mounts at each mountPath.

emptyDir: a fresh directory per pod; with medium Memory, a tmpfs (of sizeLimit, when
given) mounted on that directory, as kubelet does, so every container of the pod shares
it, writing past the limit fails with ENOSPC, and it lives until the pod is torn down.
Each pod also gets kubelet + containerd's default /dev/shm, a 64 MiB tmpfs shared by its
containers (unless a container mounts something at /dev/shm or the pod is hostIPC).
hostPath: the host path itself (created for "", DirectoryOrCreate, FileOrCreate).
persistentVolumeClaim: one directory per claim under the cluster's shared dir, so every
pod mounting the claim (on any node) sees the same files. configMap, secret, downwardAPI
and projected (including the service-account token the ServiceAccount admission plugin
injects) are written out as files.
Files are written atomically (temp + rename) so a refreshed token never reads torn.
"""

from __future__ import annotations

import base64
import ctypes
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

Obj = dict[str, Any]
TokenFn = Callable[[str | None, int], str]


class VolumeError(Exception):
    pass


SHM_PATH: Final = "/dev/shm"
# containerd's (and Docker's) /dev/shm for a pod sandbox that does not mount its own
DEFAULT_SHM_BYTES: Final = 64 * 1024 * 1024
MNT_DETACH: Final = 2
# the "device" of every tmpfs the node agents mount, so a container can tell them apart
TMPFS_SOURCE: Final = "devcluster-pod"

_libc = ctypes.CDLL(None, use_errno=True)


def memory_size(vol: Obj) -> int | None:
    """Bytes of the tmpfs for an emptyDir of medium Memory: its sizeLimit rounded up, or 0
    for no limit (absent or zero, as kubelet reads it: tmpfs's own default, half the RAM
    here); None for any other volume."""
    empty = vol.get("emptyDir")
    if empty is None or empty.get("medium") != "Memory":
        return None
    limit = empty.get("sizeLimit")
    if limit is None:
        return 0
    from elasticjob_devcluster.pod_env import parse_quantity  # container_init needs not

    try:
        nbytes = math.ceil(parse_quantity(str(limit)))
    except ValueError as e:
        raise VolumeError(f"volume {vol['name']!r}: sizeLimit {limit!r}: {e}") from e
    if nbytes < 0:
        raise VolumeError(f"volume {vol['name']!r}: sizeLimit {limit!r} must not be negative")
    return nbytes


def mounts_shm(container: Obj) -> bool:
    """The container mounts a volume of its own at /dev/shm."""
    mounts = container.get("volumeMounts") or []
    return any(str(m.get("mountPath", "")).rstrip("/") == SHM_PATH for m in mounts)


def mount_tmpfs(target: Path, size: int, mode: int) -> None:
    """A fresh tmpfs of ``size`` bytes (0: no limit) on ``target``, unless one is there."""
    target.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(target):  # an agent restart or a refresh: keep what the pod wrote
        return
    options = f"mode={mode:o}" + (f",size={size}" if size else "")
    rc = _libc.mount(TMPFS_SOURCE.encode(), str(target).encode(), b"tmpfs", 0, options.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise VolumeError(f"mount tmpfs ({options}) on {target}: {os.strerror(err)}")


def _unescape(field: str) -> str:
    """Undo /proc/self/mountinfo's octal escapes (a space appears as backslash 040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _deepest_first(paths: list[Path]) -> list[Path]:
    return sorted(set(paths), key=lambda p: (-len(p.parts), str(p)))


def mounts_under(root: Path, mountinfo: str) -> list[Path]:
    """Mount points strictly inside ``root`` in a mountinfo text, deepest first."""
    inside = []
    prefix = str(root.resolve()).rstrip("/") + "/"
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and _unescape(fields[4]).startswith(prefix):
            inside.append(Path(_unescape(fields[4])))
    return _deepest_first(inside)


def pod_tmpfs_mounts(mountinfo: str) -> list[Path]:
    """Mount points of the tmpfs the node agents mounted (any node, any cluster), deepest
    first. After the optional fields, a " - " separates fstype, source and options."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        tail = fields[fields.index("-") + 1 :] if "-" in fields else []
        if len(fields) > 4 and tail[:2] == ["tmpfs", TMPFS_SOURCE]:
            found.append(Path(_unescape(fields[4])))
    return _deepest_first(found)


def _read_mountinfo() -> str:
    try:
        return Path("/proc/self/mountinfo").read_text()
    except OSError:
        return ""


def _detach(targets: list[Path]) -> list[Path]:
    """Lazy unmounts (MNT_DETACH): a process still using a tmpfs keeps it until it exits."""
    return [t for t in targets if _libc.umount2(str(t).encode(), MNT_DETACH) == 0]


def unmount_under(root: Path) -> list[Path]:
    """Detach every mount inside ``root`` (a pod's tmpfs volumes), so it can be removed."""
    return _detach(mounts_under(root, _read_mountinfo()))


def detach_other_pod_tmpfs(keep: set[str]) -> list[Path]:
    """In a new container's mount namespace: detach its copies of the pods' tmpfs mounts
    (its own are bound at ``keep`` by now). A copy would keep another pod's tmpfs, and its
    memory, alive after that pod has gone."""
    return _detach([p for p in pod_tmpfs_mounts(_read_mountinfo()) if str(p) not in keep])


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
    size = memory_size(vol)
    if size is not None:
        mount_tmpfs(target, size, 0o777)  # kubelet's emptyDir mode
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
