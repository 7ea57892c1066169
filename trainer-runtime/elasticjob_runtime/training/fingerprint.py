"""Fingerprints of training state, and the rule that says which ranks disagree.

Data-parallel ranks hold bitwise-identical weights, optimizer state and schedules: they
start equal and apply the same all-reduced gradients with the same arithmetic. A rank
that differs is training a different model, and nothing else would ever say so (the
job still finishes, with exit 0). So the Run compares, over the group, one 64-bit
fingerprint per piece of state: at the first step after every regroup and restore
(which also shows state that never went through the Run), and every ``check_every``
steps.

A tensor's fingerprint is the sum of its elements read as integers of the same width,
with its dtype and shape: one pass over memory (about 2 ms for 3.3M float32 on one core
here), exact, and changed by any difference that training produces (a different LR, a
lost gradient, a stale EMA all change many elements). Modules are fingerprinted by their
parameters only: buffers such as BatchNorm's running statistics legitimately differ
between ranks (each rank updates them from its own batch; DDP broadcasts rank 0's at the
next forward).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from elasticjob_runtime.training.seeds import mix

_SIGNED_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NONE = 0x4E4F_4E45  # "NONE"


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The exact sum of the tensor's elements read as integers of their width (int64, one
    element): the part of a fingerprint that adds up across shards.

    Narrower than 8 bytes on the CPU, numpy sums: torch's widening sum (an int32 read
    summed into int64) took 90-105 ms for one tensor of 13M float32 here, numpy's 8-14
    ms, and the check after every regroup fingerprints all the state on the group's
    time (bench/fingerprint_cost.py). The value is the same."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    as_ints = t.view(_SIGNED_BY_SIZE[t.element_size()])
    if t.device.type == "cpu" and t.element_size() < 8:
        total = int(as_ints.numpy().sum(dtype=np.int64))
        return torch.tensor([total], dtype=torch.int64)
    return as_ints.sum(dtype=torch.int64).reshape(1)


def tensor_fingerprint(tensor: torch.Tensor) -> int:
    """Exact integer sum of the tensor's bits, mixed with its dtype and shape."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    total = int(bit_sum(t).item()) if t.numel() else 0
    return mix(zlib.crc32(str(t.dtype).encode()), *t.shape, total)


def sharded_fingerprint(obj: Any) -> int:
    """:func:`fingerprint` of the whole of a sharded model or optimizer, the same at any
    world size and mesh: each DTensor counts by its global shape and the sum of its rows
    over one replica (HSDP's other replicas hold the same rows and add nothing), one
    all-reduce a tensor over the default group, so every rank calls it. For tests and
    logs of small models: it is a collective per tensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    def first_replica(value: DTensor) -> bool:
        coordinate = list(value.device_mesh.get_coordinate() or ())
        return all(
            c == 0
            for c, p in zip(coordinate, value.placements, strict=True)
            if isinstance(p, Replicate)
        )

    def whole(value: Any) -> Any:
        if isinstance(value, DTensor):
            total = bit_sum(value.to_local())
            if not first_replica(value):
                total.zero_()
            dist.all_reduce(total)
            return ("dtensor", str(value.dtype), tuple(value.shape), int(total.item()))
        if isinstance(value, Mapping):
            return {k: whole(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [whole(v) for v in value]
        return value

    if isinstance(obj, nn.Module):
        return value_fingerprint(whole(dict(obj.named_parameters())))
    state_dict = getattr(obj, "state_dict", None)
    return value_fingerprint(whole(state_dict() if callable(state_dict) else obj))


def value_fingerprint(value: Any) -> int:
    """Fingerprint of a state_dict-like value: tensors, containers and plain values."""
    if isinstance(value, torch.Tensor):
        return tensor_fingerprint(value)
    if isinstance(value, Mapping):
        parts = [mix(value_fingerprint(k), value_fingerprint(v)) for k, v in value.items()]
        return mix(0x4D41_5050, len(parts), sum(parts))  # order-free: dicts are unordered
    if isinstance(value, set | frozenset):  # iteration order varies between processes
        return mix(0x5345_5421, len(value), sum(value_fingerprint(v) for v in value))
    if isinstance(value, list | tuple):
        return mix(0x5345_5121, len(value), *(value_fingerprint(v) for v in value))
    if isinstance(value, bool):
        return mix(0x424F_4F4C, int(value))
    if isinstance(value, int):
        return mix(0x494E_5421, value & ((1 << 64) - 1), value >> 64)
    if isinstance(value, float):
        return mix(0x464C_5421, struct.unpack("<q", struct.pack("<d", value))[0])
    if isinstance(value, str | bytes):
        raw = value.encode() if isinstance(value, str) else value
        return mix(0x5354_5221, zlib.crc32(raw), len(raw))
    if value is None:
        return _NONE
    # Anything else (a user's object inside a state_dict): its repr, unless that names a
    # memory address (different in every process): then only its type.
    text = repr(value)
    if " at 0x" in text:
        text = type(value).__qualname__
    return mix(0x4F42_4A21, zlib.crc32(text.encode()))


def fingerprint(obj: Any) -> int:
    """Fingerprint of a module (its parameters), a Stateful (its state_dict) or a value."""
    inner = getattr(obj, "module", None)
    if isinstance(obj, nn.parallel.DistributedDataParallel) and inner is not None:
        obj = inner
    if isinstance(obj, nn.Module):
        return value_fingerprint(dict(obj.named_parameters()))
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):
        return value_fingerprint(state_dict())
    return value_fingerprint(obj)


def as_signed(value: int) -> int:
    """A 64-bit fingerprint as the int64 a tensor holds."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class Disagreement:
    """One piece of state the ranks do not agree on: ranks grouped by what they hold,
    the largest group (the majority) first."""

    name: str
    groups: tuple[tuple[int, ...], ...]
    shard: int | None = None  # compared only among the ranks that hold this shard (HSDP)

    def describe(self) -> str:
        ranks = " vs ".join(str(list(group)) for group in self.groups)
        return f"{self.name!r} differs (ranks {ranks})"


def disagreements(names: Sequence[str], rows: Sequence[Sequence[int]]) -> list[Disagreement]:
    """Which named fingerprints differ between ranks; ``rows[r]`` is rank r's, in
    ``names`` order. Empty when every rank holds the same state."""
    found = []
    for column, name in enumerate(names):
        by_value: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            by_value.setdefault(row[column], []).append(rank)
        if len(by_value) > 1:
            groups = sorted(by_value.values(), key=lambda ranks: (-len(ranks), ranks))
            found.append(Disagreement(name, tuple(tuple(g) for g in groups)))
    return found


def disagreements_within(
    names: Sequence[str], cohorts: Sequence[int], rows: Sequence[Sequence[int]]
) -> list[Disagreement]:
    """:func:`disagreements` among the ranks of each cohort (``cohorts[r]`` is rank r's:
    HSDP's ranks that hold one shard), never across cohorts; ranks as in ``rows``."""
    found = []
    for cohort in sorted(set(cohorts)):
        members = [rank for rank, c in enumerate(cohorts) if c == cohort]
        for d in disagreements(names, [rows[m] for m in members]):
            groups = tuple(tuple(members[i] for i in group) for group in d.groups)
            found.append(Disagreement(f"{d.name} of shard {cohort}", groups, shard=cohort))
    return found


def divergence_message(step: int, when: str, found: Sequence[Disagreement]) -> str:
    """One line: what differs, between which ranks, and how to fix the script (HSDP
    replicas that hold one shard differently call for other advice than the rest)."""
    what = "; ".join(d.describe() for d in found)
    if found and all(d.shard is not None for d in found):
        return (
            f"the ranks trained different models: at step {step} ({when}) {what}. HSDP "
            "replicas must hold each shard alike: change the parameters only through the "
            "optimizer's step, the same on every rank (nothing rank-dependent after build), "
            "or pass on_divergence='resync' to copy the first replica's shards "
            "(docs/training-loop.md, HSDP)"
        )
    return (
        f"the ranks trained different models: at step {step} ({when}) {what}. Every object "
        "that changes during training must go through the Run, or a restarted or joining "
        "worker starts it afresh: pass LR schedulers, EMA models, GradScalers and extra "
        "optimizers as run.wrap(..., state={'name': obj}); put step-dependent work (the "
        "scheduler's step, the EMA update) inside `with run.step():`; read rank and world "
        "size from run.rank and run.world_size, not once at start-up (docs/training-loop.md)"
    )


class DivergenceError(RuntimeError):
    """The ranks hold different training state; the job stops rather than finish wrong."""
