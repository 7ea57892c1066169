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
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessRecord:
    """A started process: its pid (also its process-group id) and kernel start time."""

    name: str
    pid: int
    start_ticks: int


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/pid/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces; fields resume after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def is_alive(record: ProcessRecord) -> bool:
    """True while the recorded process (not a pid reuse) exists and is not a zombie."""
    if start_ticks(record.pid) != record.start_ticks:
        return False
    try:
        state = Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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


def _signal_group(record: ProcessRecord, sig: signal.Signals) -> None:
    # the group outlives its leader: signal it whenever the leader is ours or gone
    leader_reused = start_ticks(record.pid) not in (None, record.start_ticks)
    if leader_reused:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, sig)


def _group_alive(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def stop(records: Sequence[ProcessRecord], grace_seconds: float = 10.0) -> None:
    """SIGTERM each recorded process group, wait up to ``grace_seconds``, then SIGKILL."""
    for record in records:
        _signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    pending = list(records)
    while pending and time.monotonic() < deadline:
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


# Helper processes that multiprocessing starts beside the real workers.
HELPER_MARKERS = ("resource_tracker", "semaphore_tracker", "forkserver")


def newest_worker_child(pid: int) -> tuple[int, str] | None:
    """The newest live child of ``pid`` that runs python and is not one of
    multiprocessing's helpers: for a launcher such as torchrun, a training worker.
    Returns (pid, command line) or None."""
    best: tuple[int, int, str] | None = None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, UnicodeDecodeError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z" or int(fields[1]) != pid:
            continue
        if "python" not in cmdline or any(m in cmdline for m in HELPER_MARKERS):
            continue
        ticks = int(fields[19])
        if best is None or ticks > best[0]:
            best = (ticks, int(entry.name), cmdline)
    return None if best is None else (best[1], best[2])


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` from /proc: launchers start workers in sessions of
    their own, so a process group does not find them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
