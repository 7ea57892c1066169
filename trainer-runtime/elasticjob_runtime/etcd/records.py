"""The records the runtime publishes in the run's etcd and the operator reads back.

One format for each, defined once: the training progress that global rank 0 publishes
(:class:`Progress`, mirrored into the job's ``status.progress``), a pod's report that
its node-memory checkpoint copy failed (:class:`MemoryFallback`, said once in the job's
events), an agent's record that the group hung (:class:`Hang`, an event per round) and
a worker's record that the ranks trained different models (:class:`Divergence`: the
job fails, or with ``resync`` an event says so), and what an agent's member key holds
(:class:`Member`: the operator maps a pod it removes to its node by the address).
JSON with snake_case keys; a field a newer runtime adds is ignored by an older reader.
Pure (json only: no etcd client, no torch), so the operator decodes with the very code
the runtime encodes with.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """One progress record as stored in etcd."""

    step: int
    samples_per_second: float
    world_size: int
    restart_count: int
    updated: float  # unix time of the publish
    epoch: int | None = None
    checkpoint_step: int | None = None
    checkpoint_error: str | None = None  # why the newest save failed; None once one works
    # the goodput ledger as goodput/ledger.py encodes it (decoded there: a malformed one
    # costs the reader the ledger, never the progress)
    ledger: dict[str, Any] | None = None


@dataclass(frozen=True)
class MemoryFallback:
    """One pod's node-memory checkpoint copy failed; restarts there read the disk copy."""

    pod: str
    step: int
    checkpoint_bytes: int
    shm_bytes: int | None  # size of the filesystem holding the copy (/dev/shm)
    free_bytes: int | None  # free on it after the failed write was removed
    no_space: bool  # ENOSPC: it did not fit (else another error, in ``error``)
    error: str
    updated: float


@dataclass(frozen=True)
class Hang:
    """The worker group made no step progress for the hang timeout in round ``round``;
    the agent that noticed first (``pod``) restarted its workers."""

    round: int
    pod: str
    step: int  # the last step the group completed
    stalled_seconds: float
    timeout_seconds: float
    updated: float


def encode_hang(hang: Hang) -> bytes:
    return json.dumps(asdict(hang), sort_keys=True).encode()


def decode_hang(raw: bytes) -> Hang:
    """Parse a stored hang record; ValueError naming the field if it is not one."""
    doc = _document(raw, "hang record")
    return Hang(
        round=_int(doc, "round"),
        pod=str(doc.get("pod") or ""),
        step=_int(doc, "step"),
        stalled_seconds=_float(doc, "stalled_seconds"),
        timeout_seconds=_float(doc, "timeout_seconds"),
        updated=_float(doc, "updated", 0.0),
    )


@dataclass(frozen=True)
class Divergence:
    """The ranks held different training state at ``step`` (fingerprint.py):
    ``action`` ``stop`` (the workers stopped; the job fails) or ``resync`` (rank 0's
    state was copied to every rank and training went on)."""

    step: int
    action: str
    message: str
    pod: str
    updated: float


DIVERGENCE_ACTIONS = ("stop", "resync")


def encode_divergence(divergence: Divergence) -> bytes:
    return json.dumps(asdict(divergence), sort_keys=True).encode()


def decode_divergence(raw: bytes) -> Divergence:
    """Parse a stored divergence record; ValueError naming the field if it is not one."""
    doc = _document(raw, "divergence record")
    action = str(doc.get("action") or "")
    if action not in DIVERGENCE_ACTIONS:
        raise ValueError(f"divergence record: action {action!r} is not stop or resync")
    return Divergence(
        step=_int(doc, "step"),
        action=action,
        message=str(doc.get("message") or ""),
        pod=str(doc.get("pod") or ""),
        updated=_float(doc, "updated", 0.0),
    )


@dataclass(frozen=True)
class Member:
    """What an agent's member key holds (``rdzv/members/<node>``): the address it
    rendezvouses from (``--local-addr``; in a pod, the pod's IP), its pid, and the port
    it listens on there while it lives (rendezvous/liveness.py; None: none). The
    operator finds the node of a pod it removes by that address."""

    addr: str
    pid: int
    port: int | None = None
    ttl: int | None = None  # its member lease's TTL as granted: how long a watcher waits


def encode_member(member: Member) -> bytes:
    return json.dumps(asdict(member), sort_keys=True).encode()


def decode_member(raw: bytes) -> Member:
    """Parse a member key's value; ValueError naming the field if it is not one."""
    doc = _document(raw, "member record")
    addr = doc.get("addr")
    if not isinstance(addr, str) or not addr:
        raise ValueError("member record: 'addr' must be a non-empty string")
    return Member(
        addr=addr, pid=_int(doc, "pid"), port=_opt_int(doc, "port"), ttl=_opt_int(doc, "ttl")
    )


def encode_progress(progress: Progress) -> bytes:
    return json.dumps(asdict(progress), sort_keys=True).encode()


def decode_progress(raw: bytes) -> Progress:
    """Parse a stored record; ValueError naming the field if it is not one."""
    doc = _document(raw, "progress record")
    return Progress(
        step=_int(doc, "step"),
        samples_per_second=_float(doc, "samples_per_second"),
        world_size=_int(doc, "world_size"),
        restart_count=_int(doc, "restart_count"),
        updated=_float(doc, "updated"),
        epoch=_opt_int(doc, "epoch"),
        checkpoint_step=_opt_int(doc, "checkpoint_step"),
        checkpoint_error=_opt_str(doc, "checkpoint_error"),
        ledger=ledger if isinstance(ledger := doc.get("ledger"), dict) else None,
    )


def encode_memory_fallback(report: MemoryFallback) -> bytes:
    return json.dumps(asdict(report), sort_keys=True).encode()


def decode_memory_fallback(raw: bytes) -> MemoryFallback:
    """Parse a stored report; ValueError naming the field if it is not one."""
    doc = _document(raw, "node-memory fallback report")
    pod = doc.get("pod")
    if not isinstance(pod, str) or not pod:
        raise ValueError("node-memory fallback report: 'pod' must be a non-empty string")
    return MemoryFallback(
        pod=pod,
        step=_int(doc, "step"),
        checkpoint_bytes=_int(doc, "checkpoint_bytes"),
        shm_bytes=_opt_int(doc, "shm_bytes"),
        free_bytes=_opt_int(doc, "free_bytes"),
        no_space=doc.get("no_space") is not False,
        error=str(doc.get("error") or ""),
        updated=_float(doc, "updated", 0.0),
    )


# -- field readers: a number is a finite int or float, never a bool or a numeric string


def _document(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: a JSON object was expected, got {type(doc).__name__}")
    return doc


def _number(doc: dict[str, Any], name: str) -> float | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name!r} must be a finite number, got {value!r}")
    return float(value)


def _int(doc: dict[str, Any], name: str) -> int:
    value = _number(doc, name)
    if value is None:
        raise ValueError(f"{name!r} is missing")
    return int(value)


def _opt_int(doc: dict[str, Any], name: str) -> int | None:
    value = _number(doc, name)
    return None if value is None else int(value)


def _opt_str(doc: dict[str, Any], name: str) -> str | None:
    value = doc.get(name)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{name!r} must be a string, got {value!r}")


def _float(doc: dict[str, Any], name: str, default: float | None = None) -> float:
    value = _number(doc, name)
    if value is not None:
        return value
    if default is None:
        raise ValueError(f"{name!r} is missing")
    return default
