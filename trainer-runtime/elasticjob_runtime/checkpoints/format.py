"""What a checkpoint is: ``torch.save`` bytes of a mapping of state, loaded as data only.

Saving and restoring (:mod:`elasticjob_runtime.checkpoints.manager`), reading and agreeing
(:mod:`elasticjob_runtime.checkpoints.restore`) and ``Run``'s hand-over of state
to a joining rank all turn state into these bytes and back, so the format and its errors
live here, below all of them.

Values with a ``state_dict()`` (modules, optimizers, samplers, schedulers) are saved
through it, DDP/DataParallel wrappers are unwrapped to ``.module`` so the checkpoint
loads into an unwrapped model too; anything else must be picklable. Loading is data only
(``torch.load(weights_only=True)``): a checkpoint that needs more raises
:class:`UnsafeCheckpointError` unless its classes are registered with
``torch.serialization.add_safe_globals`` or the caller passes ``weights_only=False``.

Our saves leave out the CRC-32 torch's zip writer computes for every record: torch's
loader never checks it (bytes sent to a peer gained nothing from it), and a checkpoint
file is checked by its commit marker's SHA-256. It was 18 of the 31 ms ``torch.save``
took for the realistic example's 53 MB (``bench/save_cost.py``), CPU a full node takes
from training. torch has one switch for it (``torch.serialization.set_crc32_options``),
per thread since torch 2.13 and per process before, so a save turns it off only while
it runs and puts it back as it found it; before 2.13 a ``torch.save`` of the script's
own in another thread at that moment also writes zeros there, which torch loads all
the same.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from elasticjob_runtime.checkpoints.files import Sink


class CheckpointError(RuntimeError):
    """A save or restore that cannot go on; the message says what to fix."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that only full unpickling (which can run any code) would load."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its step, the saved mapping and where it came from."""

    step: int
    state: dict[str, Any]
    path: Path


def unwrap(obj: Any) -> Any:
    """The module inside a DDP/DataParallel wrapper, else ``obj`` itself."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return obj.module if isinstance(obj, wrappers) else obj


def state_to_save(state: Mapping[str, Any]) -> dict[str, Any]:
    """Turn live objects into what is saved: ``state_dict()`` where there is one."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        inner = unwrap(value)
        method = getattr(inner, "state_dict", None)
        out[key] = method() if callable(method) else value
    return out


def serialize(state: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    serialize_into(state, buf)
    return buf.getvalue()


def serialize_into(state: Mapping[str, Any], sink: Sink) -> None:
    """The same bytes as :func:`serialize`, written as they are made: ``torch.save``
    writes only, each storage as one memoryview of its bytes."""
    with _zip_checksums_off():
        torch.save(dict(state), cast(IO[bytes], sink))


_ZIP_CHECKSUM_SWITCH = threading.Lock()  # held by the one save that turned the CRC off


@contextlib.contextmanager
def _zip_checksums_off() -> Iterator[None]:
    """``torch.save`` without its per-record CRC-32 within (see the module docstring).

    One save at a time turns it off and puts it back as it found it; a save of ours
    that overlaps it leaves the switch alone (it may compute the CRC: slower, the same
    data). So the setting always ends as the script left it, whether torch keeps it per
    thread (2.13) or per process (2.11)."""
    if not _ZIP_CHECKSUM_SWITCH.acquire(blocking=False):
        yield
        return
    try:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(before)
    finally:
        _ZIP_CHECKSUM_SWITCH.release()


def deserialize(
    data: bytes, weights_only: bool = True, map_location: str = "cpu", source: str = "bytes"
) -> dict[str, Any]:
    """``torch.load`` the bytes, with torch's safe loader unless ``weights_only=False``.

    The safe loader builds tensors, containers and primitives and calls no other code;
    a checkpoint that needs more raises :class:`UnsafeCheckpointError` naming ``source``,
    what it needs and how to allow it.
    """
    try:
        loaded = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if not weights_only:
            raise
        raise UnsafeCheckpointError(unsafe_message(source, str(exc))) from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"checkpoint holds a {type(loaded).__name__}, expected a dict")
    return loaded


def unsafe_message(source: str, error: str) -> str:
    """One line: what the safe loader refused in ``source`` and the two ways to allow it."""
    found = re.search(r"GLOBAL (\S+) was not an allowed global", error)
    need = f"needs {found.group(1)}" if found else f"is not plain data ({error.splitlines()[0]})"
    return (
        f"checkpoint {source} {need}, which the safe loader refuses (loading it could run "
        "any code); register a class you trust with torch.serialization.add_safe_globals, "
        "or pass weights_only=False to restore()/load_latest() if you trust every "
        "checkpoint this job reads (its directory, node memory and peers)"
    )
