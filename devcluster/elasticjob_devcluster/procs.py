"""Start processes in their own process group, record them, and stop exactly those.

Every process the devcluster starts is recorded as (pid, start time) so that
``down`` stops it by its process group even after a crash of whoever started it,
and never signals an unrelated process that happens to reuse the pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessRecord:
    """A started process: its pid (also its process-group id) and kernel start time."""

    name: str
    pid: int
    start_ticks: int


# Indices into the fields :func:`_stat` returns (field 3 of /proc/pid/stat is index 0).
STATE, PPID, PGRP, START_TICKS = 0, 1, 2, 19


def _stat(pid: int | str) -> list[str] | None:
    """Fields 3 onwards of /proc/<pid>/stat, or None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces; fields resume after the last ')'
    return stat[stat.rindex(")") + 2 :].split()


def _processes() -> Iterator[tuple[int, list[str]]]:
    """Every process in /proc now, with its :func:`_stat` fields."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(entry.name)
            if fields is not None:
                yield int(entry.name), fields


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/pid/stat)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[START_TICKS])


def is_alive(record: ProcessRecord) -> bool:
    """True while the recorded process (not a pid reuse) exists and is not a zombie."""
    fields = _stat(record.pid)
    return (
        fields is not None
        and int(fields[START_TICKS]) == record.start_ticks
        and fields[STATE] != "Z"
    )


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start ``argv`` in a new session (so its pid is its process group), output to a log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    ticks = start_ticks(proc.pid)
    return proc, ProcessRecord(name, proc.pid, ticks if ticks is not None else -1)


def save_records(path: Path, records: Sequence[ProcessRecord]) -> None:
    """Write records atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in records], indent=1))
    tmp.replace(path)


def load_records(path: Path) -> list[ProcessRecord]:
    try:
        return [ProcessRecord(**r) for r in json.loads(path.read_text())]
    except FileNotFoundError:
        return []


def replaced(
    records: Sequence[ProcessRecord], old: ProcessRecord, new: ProcessRecord
) -> list[ProcessRecord]:
    """``records`` with ``old`` swapped for ``new`` in its place: a restarted process keeps
    its position, since ``down`` stops the control plane in reverse start order."""
    if old not in records:
        raise ValueError(f"{old.name} (pid {old.pid}) is not among the records to replace")
    return [new if r == old else r for r in records]


def group_exists(record: ProcessRecord) -> bool:
    """The recorded process (not a reuse of its pid) or its process group still exists."""
    if _leader_reused(record):
        return False
    try:
        os.killpg(record.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class RecordFile:
    """A records file that several threads add to (a node agent's containers and exec
    probes); each addition drops the records whose whole group is gone, so short-lived
    processes do not pile up."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def add(self, proc: subprocess.Popen[bytes], name: str) -> None:
        ticks = start_ticks(proc.pid)
        record = ProcessRecord(name, proc.pid, ticks if ticks is not None else -1)
        with self._lock:
            live = [r for r in load_records(self.path) if group_exists(r)]
            save_records(self.path, [*live, record])


def _signal_group(record: ProcessRecord, sig: signal.Signals) -> None:
    # the group outlives its leader: signal it whenever the leader is ours or gone
    if _leader_reused(record):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, sig)


def _group_alive(pgid: int) -> bool:
    return any(f[STATE] != "Z" and int(f[PGRP]) == pgid for _, f in _processes())


def stop(
    records: Sequence[ProcessRecord],
    grace_seconds: float = 10.0,
    done: Callable[[], bool] | None = None,
) -> None:
    """SIGTERM each recorded process group, wait up to ``grace_seconds``, then SIGKILL.
    ``done``: the wait also ends once it is true, e.g. a server that has stopped listening
    but would hold its open streams until its own shutdown timeout."""
    for record in records:
        _signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    pending = list(records)
    while pending and time.monotonic() < deadline and not (done is not None and done()):
        pending = [r for r in pending if _group_alive(r.pid) and not _leader_reused(r)]
        if pending:
            time.sleep(0.1)
    for record in pending:
        _signal_group(record, signal.SIGKILL)
    # SIGKILL is asynchronous: wait (briefly) until the kernel has taken the groups down
    deadline = time.monotonic() + 5.0
    while alive_groups(pending) and time.monotonic() < deadline:
        time.sleep(0.05)


def _leader_reused(record: ProcessRecord) -> bool:
    return start_ticks(record.pid) not in (None, record.start_ticks)


def alive_groups(records: Sequence[ProcessRecord]) -> list[ProcessRecord]:
    """Records whose process group still has a live member."""
    return [r for r in records if not _leader_reused(r) and _group_alive(r.pid)]


# Helper processes that multiprocessing starts beside the real workers, and elasticjob-run's
# idle warm spares (a spare that became a worker shows the worker's command line).
HELPER_MARKERS = (
    "resource_tracker",
    "semaphore_tracker",
    "forkserver",
    "elasticjob_runtime.launch.spare",
)


def newest_worker_child(pid: int) -> tuple[int, str] | None:
    """The newest live child of ``pid`` that runs python and is not one of
    multiprocessing's helpers: for a launcher such as torchrun, a training worker.
    Returns (pid, command line) or None."""
    best: tuple[int, int, str] | None = None
    for child, fields in _processes():
        if fields[STATE] == "Z" or int(fields[PPID]) != pid:
            continue
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            command = cmdline.decode().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if "python" not in command or any(m in command for m in HELPER_MARKERS):
            continue
        ticks = int(fields[START_TICKS])
        if best is None or ticks > best[0]:
            best = (ticks, child, command)
    return None if best is None else (best[1], best[2])


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` from /proc: launchers start workers in sessions of
    their own, so a process group does not find them."""
    children: dict[int, list[int]] = {}
    for child, fields in _processes():
        children.setdefault(int(fields[PPID]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
