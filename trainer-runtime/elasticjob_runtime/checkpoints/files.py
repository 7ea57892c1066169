"""Checkpoint files: names, commit markers, durable writes, verified reads, pruning.

On disk a checkpoint is ``step-<step>.pt`` plus ``step-<step>.pt.commit``, a small
JSON marker with the size and SHA-256 of the data file and the identity of the job that
wrote it (:mod:`elasticjob_runtime.checkpoints.job_identity`). Both are written as temp file, fsync,
rename, fsync of the directory, and the marker only after the data file is durable, so a
checkpoint without its marker is a save that did not finish. A write that fails (a full
or read-only filesystem) removes its temp file and, if the marker failed, the data file:
what was committed before stays as it was.

A checkpoint is written as it is serialized (a :data:`Fill`), hashed on the way, and its
second copy (node memory beside the directory) is a kernel copy of the first
(``sendfile``): no copy of the bytes is ever held in the process, which used to hold two
(a ``BytesIO`` and its ``getvalue()``) and copied them twice more in Python.

Also where this pod's node-memory copy lives (``/dev/shm/elasticjob/<job>/<pod>``, made
0700, the job part named by its identity), its removal once the job has succeeded, and how
much room its filesystem has. Bytes in, bytes out, no torch:
:mod:`elasticjob_runtime.checkpoints.format` turns training state into those bytes and
back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.job_identity import directory_name

_DATA_RE = re.compile(r"^step-(\d+)\.pt$")
MARKER_SUFFIX = ".commit"
DEFAULT_MEMORY_ROOT = "/dev/shm"


class Sink(Protocol):
    """Where a :data:`Fill` writes: all a ``torch.save`` into a file object needs."""

    def write(self, data: bytes | memoryview, /) -> int: ...


Fill = Callable[[Sink], object]
"""Writes a file's bytes into a :class:`Sink`: ``torch.save`` of a state, for one."""


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
    job: str = ""  # identity of the job that wrote it ("": a runtime before identities)

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
            job=str(doc.get("job") or ""),
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


def _write_atomic(directory: Path, name: str, fill: Callable[[BinaryIO], object]) -> Path:
    """Write ``directory/name`` so that it is either absent or complete, and durable."""
    target = directory / name
    tmp = directory / f".{name}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(directory)
    return target


def write_atomic(directory: Path, name: str, data: bytes) -> Path:
    """Write ``directory/name`` so that it is either absent or complete, and durable."""
    return _write_atomic(directory, name, lambda f: f.write(data))


@dataclass(frozen=True)
class Written:
    """A committed checkpoint's data file, its size and SHA-256: what its marker says,
    and what a second copy of it needs (:func:`commit` copies it without reading it)."""

    path: Path
    size: int
    sha256: str


class _Hashing:
    """A write-only file that hashes and counts what passes through it to the file
    :meth:`fill` names. ``torch.save`` hands it each storage as a memoryview: nothing is
    copied here."""

    def __init__(self) -> None:
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self.size = 0
        # the write that failed: torch.save's zip writer, closing on the way out, raises
        # a RuntimeError of its own that would hide it (a full disk must stay an OSError)
        self.failed: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        self._hash.update(view)  # releases the GIL for large buffers, as the write does
        self.size += view.nbytes
        assert self._file is not None
        try:
            self._file.write(view)
        except OSError as exc:
            self.failed = exc
            raise
        return view.nbytes

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def fill(self, fill: Fill, file: BinaryIO) -> None:
        """``fill`` into ``file`` through this sink; a write that failed is what raises."""
        self._file = file
        try:
            fill(self)
        except Exception:
            if self.failed is not None:
                raise self.failed from None
            raise


def _copy_file(source: Path, out: BinaryIO, size: int) -> None:
    """``size`` bytes of ``source`` appended to ``out``, copied by the kernel."""
    out.flush()
    with open(source, "rb") as src:
        offset = 0
        while offset < size:
            try:
                sent = os.sendfile(out.fileno(), src.fileno(), offset, size - offset)
            except OSError as exc:  # a filesystem without sendfile: copy through Python
                if offset or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                shutil.copyfileobj(src, out)
                sent = size
            if sent == 0:
                raise OSError(errno.EIO, f"{source} ended at byte {offset} of {size}")
            offset += sent


def make_private_dirs(directory: Path, shared: Path | None = None) -> None:
    """Create ``directory`` and its missing parents 0700 (whatever the umask), but
    ``shared`` (a parent every user's jobs use, ``/dev/shm/elasticjob``) 1777 like /tmp."""
    missing = [d for d in (directory, *directory.parents) if not d.is_dir()]
    for d in reversed(missing):
        mode = 0o1777 if d == shared else 0o700
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=mode)
            os.chmod(d, mode)


def commit(
    directory: Path,
    step: int,
    content: bytes | Fill | Written,
    *,
    job: str = "",
    private: bool = False,
    shared: Path | None = None,
) -> Written:
    """Write one checkpoint: data file, then its marker.

    ``content``: the bytes, a :data:`Fill` that writes them (hashed as they pass), or
    a checkpoint committed elsewhere, copied by the kernel with its size and digest (the
    same state goes to disk and node memory; hashing a GB takes seconds). ``private``
    creates missing directories as :func:`make_private_dirs` does. When the marker cannot
    be written the data file goes too (it would only hold the space a full filesystem
    lacks).
    """
    if private:
        make_private_dirs(directory, shared)
    else:
        directory.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    if isinstance(content, Written):
        source = content
        path = _write_atomic(directory, name, lambda f: _copy_file(source.path, f, source.size))
        written = Written(path, source.size, source.sha256)
    else:
        fill: Fill = content if callable(content) else (lambda f: f.write(content))
        hashing = _Hashing()
        path = _write_atomic(directory, name, lambda f: hashing.fill(fill, f))
        written = Written(path, hashing.size, hashing.hexdigest())
    record = CommitRecord(step, name, written.size, written.sha256, job)
    try:
        write_atomic(directory, name + MARKER_SUFFIX, record.to_bytes())
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    return written


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


def read_verified(directory: Path, step: int, job: str | None = None) -> tuple[bytes | None, str]:
    """The checkpoint's bytes if complete and intact, else ``(None, reason)``.

    With ``job``, a checkpoint another job wrote is refused before its data is read.
    """
    path = directory / checkpoint_name(step)
    try:
        record = read_record(directory, step)
    except FileNotFoundError:
        return None, "no commit marker (the save did not finish)"
    except (OSError, ValueError, KeyError) as exc:
        return None, f"unreadable commit marker ({exc})"
    if job is not None and record.job != job:
        return None, f"written by another job ({record.job or 'unnamed'!r}; this is {job!r})"
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


def prune(directory: Path, keep: int, protect: int | None = None) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop older ones and dead partial saves.

    Call it after a commit, with that step as ``protect``: it is never removed, even
    when the directory holds newer steps (an earlier run's, or another job's).
    """
    steps = steps_on_disk(directory)
    committed = sorted((s for s, marked in steps.items() if marked), reverse=True)
    doomed = [s for s in committed[keep:] if s != protect]
    if committed:  # a data file without marker older than a commit is an abandoned save
        doomed += [s for s, marked in steps.items() if not marked and s < committed[0]]
    for step in doomed:
        for name in (checkpoint_name(step) + MARKER_SUFFIX, checkpoint_name(step)):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()


def default_memory_dir(job: str) -> Path | None:
    """``/dev/shm/elasticjob/<job>/<pod>``, or None where there is no /dev/shm.

    ``<job>`` is named by the job's identity, never by the run id alone: torchrun's
    default run id is ``none`` for every job, and pods that share a node's /dev/shm
    (``hostIPC``, plain torchrun) would otherwise share the directory.
    """
    raw = os.environ.get(contract.CHECKPOINT_MEMORY_DIR, DEFAULT_MEMORY_ROOT)
    if raw.strip().lower() in ("", "off", "none", "0"):
        return None
    root = Path(raw)
    if not root.is_dir():
        return None
    pod = os.environ.get(contract.POD_NAME) or socket.gethostname()
    return root / "elasticjob" / directory_name(job) / re.sub(r"[^A-Za-z0-9_.-]", "_", pod)


def remove_memory_copy(directory: Path) -> bool:
    """Remove a node-memory copy (:func:`default_memory_dir`), and its job's directory once
    no other pod's copy is in it; True if there was one. Only for a job that succeeded:
    outside a pod /dev/shm is the host's, and nothing else ever frees the copy."""
    if not directory.is_dir():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another pod of the job on this host
        directory.parent.rmdir()
    return not directory.exists()


def filesystem_space(path: Path) -> tuple[int | None, int | None]:
    """(size, free bytes) of the filesystem holding ``path`` or its nearest existing parent."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return None, None
