"""Checkpoint files: names, commit markers, durable writes, verified reads, pruning.

On disk a checkpoint is ``step-<step>.pt`` plus ``step-<step>.pt.commit``, a small
JSON marker with the size and SHA-256 of the data file. Both are written as temp
file, fsync, rename, fsync of the directory, and the marker only after the data file
is durable, so a checkpoint without its marker is a save that did not finish.

Also where this pod's node-memory copy lives (``/dev/shm/elasticjob/<run>/<pod>``) and
how much room its filesystem has. Bytes in, bytes out, no torch:
:mod:`elasticjob_runtime.checkpoint` turns training state into those bytes and back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticjob_runtime import contract

_DATA_RE = re.compile(r"^step-(\d+)\.pt$")
MARKER_SUFFIX = ".commit"
DEFAULT_MEMORY_ROOT = "/dev/shm"


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint for ``step`` (zero-padded so names sort by step)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:010d}.pt"


@dataclass(frozen=True)
class CommitRecord:
    """The commit marker's content: what a complete data file looks like."""

    step: int
    file: str
    size: int
    sha256: str

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> CommitRecord:
        doc = json.loads(raw)
        record = cls(
            step=int(doc["step"]),
            file=str(doc["file"]),
            size=int(doc["size"]),
            sha256=doc["sha256"],
        )
        if record.file != checkpoint_name(record.step):
            raise ValueError(f"marker names {record.file!r} for step {record.step}")
        return record


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, name: str, data: bytes) -> Path:
    """Write ``directory/name`` so that it is either absent or complete, and durable."""
    target = directory / name
    tmp = directory / f".{name}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(directory)
    return target


def commit(directory: Path, step: int, data: bytes) -> Path:
    """Write one checkpoint: data file, then its marker. Returns the data file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    path = write_atomic(directory, name, data)
    record = CommitRecord(step, name, len(data), hashlib.sha256(data).hexdigest())
    write_atomic(directory, name + MARKER_SUFFIX, record.to_bytes())
    return path


def steps_on_disk(directory: Path) -> dict[int, bool]:
    """Every step with a data file or a marker, mapped to whether it has a marker."""
    steps: dict[int, bool] = {}
    if not directory.is_dir():
        return steps
    for entry in directory.iterdir():
        name = entry.name
        marked = name.endswith(MARKER_SUFFIX)
        match = _DATA_RE.match(name.removesuffix(MARKER_SUFFIX) if marked else name)
        if match:
            step = int(match.group(1))
            steps[step] = steps.get(step, False) or marked
    return steps


def committed_steps(directory: Path) -> list[int]:
    """Steps with a commit marker, oldest first (not verified: see ``read_verified``)."""
    return sorted(s for s, marked in steps_on_disk(directory).items() if marked)


def read_record(directory: Path, step: int) -> CommitRecord:
    return CommitRecord.from_bytes(
        (directory / (checkpoint_name(step) + MARKER_SUFFIX)).read_bytes()
    )


def read_verified(directory: Path, step: int) -> tuple[bytes | None, str]:
    """The checkpoint's bytes if complete and intact, else ``(None, reason)``."""
    path = directory / checkpoint_name(step)
    try:
        record = read_record(directory, step)
    except FileNotFoundError:
        return None, "no commit marker (the save did not finish)"
    except (OSError, ValueError, KeyError) as exc:
        return None, f"unreadable commit marker ({exc})"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "data file missing"
    except OSError as exc:
        return None, f"data file unreadable ({exc})"
    if len(data) != record.size:
        return None, f"truncated or resized ({len(data)} bytes, marker says {record.size})"
    if hashlib.sha256(data).hexdigest() != record.sha256:
        return None, "checksum mismatch (file corrupted)"
    return data, ""


def prune(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop older ones and dead partial saves."""
    steps = steps_on_disk(directory)
    committed = sorted((s for s, marked in steps.items() if marked), reverse=True)
    doomed = committed[keep:]
    if committed:  # a data file without marker older than a commit is an abandoned save
        doomed += [s for s, marked in steps.items() if not marked and s < committed[0]]
    for step in doomed:
        for name in (checkpoint_name(step) + MARKER_SUFFIX, checkpoint_name(step)):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()


def default_memory_dir(run_id: str | None = None) -> Path | None:
    """``/dev/shm/elasticjob/<run>/<pod>``, or None where there is no /dev/shm."""
    raw = os.environ.get(contract.CHECKPOINT_MEMORY_DIR, DEFAULT_MEMORY_ROOT)
    if raw.strip().lower() in ("", "off", "none", "0"):
        return None
    root = Path(raw)
    if not root.is_dir():
        return None
    run = run_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(contract.RDZV_ID)
    pod = os.environ.get(contract.POD_NAME) or socket.gethostname()
    safe = [re.sub(r"[^A-Za-z0-9_.-]", "_", part) for part in (run or "default", pod)]
    return root / "elasticjob" / safe[0] / safe[1]


def filesystem_space(path: Path) -> tuple[int | None, int | None]:
    """(size, free bytes) of the filesystem holding ``path`` or its nearest existing parent."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return None, None
