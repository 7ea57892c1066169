"""One cgroup per container, so stopping a container stops every process it started.

A process group is not enough: torch's elastic agent starts each worker in a session
of its own, so killing the container's group (or the launcher itself) left workers
running with parent 1. Kubelet kills a container through its cgroup; so do we, with
cgroup v2's ``cgroup.kill``, which takes down every member and descendant at once.

Layout: ``<cgroup2 mount>/elasticjob/<cluster>/<node>/<pod uid>/<container>``. Where
no writable cgroup2 hierarchy exists, :func:`container_path` returns None and callers
fall back to process groups.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

_CANDIDATES = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
ROOT_NAME = "elasticjob"


def _is_cgroup2(path: Path) -> bool:
    return (path / "cgroup.procs").exists() and (path / "cgroup.subtree_control").exists()


def hierarchy() -> Path | None:
    """The writable cgroup2 mount with ``cgroup.kill`` support, if any."""
    for base in _CANDIDATES:
        if not _is_cgroup2(base):
            continue
        probe = base / ROOT_NAME
        try:
            probe.mkdir(exist_ok=True)
        except OSError:
            continue
        if (probe / "cgroup.kill").exists():
            return base
    return None


def cluster_path(cluster: str) -> Path | None:
    base = hierarchy()
    return None if base is None else base / ROOT_NAME / cluster


def node_path(cluster: str, node: str) -> Path | None:
    root = cluster_path(cluster)
    return None if root is None else root / node


def pod_path(cluster: str, node: str, pod_uid: str) -> Path | None:
    node_dir = node_path(cluster, node)
    return None if node_dir is None else node_dir / pod_uid


def container_path(cluster: str, node: str, pod_uid: str, container: str) -> Path | None:
    pod_dir = pod_path(cluster, node, pod_uid)
    return None if pod_dir is None else pod_dir / container


def enter(path: Path) -> None:
    """Move the calling process into ``path`` (created if needed); its children follow."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.procs").write_text(str(os.getpid()))


def members(path: Path) -> list[int]:
    """Pids in ``path`` and every cgroup below it."""
    if not path.is_dir():
        return []
    pids: list[int] = []
    for procs in sorted(path.rglob("cgroup.procs")):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in procs.read_text().split()]
    return pids


def kill(path: Path | None, timeout: float = 5.0) -> None:
    """SIGKILL everything in ``path`` and below, wait until it is empty, remove it."""
    if path is None or not path.is_dir():
        return
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    while members(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    remove(path)


def remove(path: Path) -> None:
    """rmdir ``path`` and its empty descendants, deepest first (non-empty ones stay)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
