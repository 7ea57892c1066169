"""Moving dim-0 shards from one mesh to another, from the survivors' memory.

FSDP2 shards every parameter (and the optimizer's state of it) along dim 0 the way
``torch.chunk`` does: ``ceil(rows / shards)`` rows a shard, the last ones short or empty.
Pure FSDP cuts as many shards as there are ranks; HSDP cuts one per rank of a shard group
and every replica holds them all (mesh_shape.py: rank ``r`` holds shard ``r % shards``).
When the world changes in place, each rank of the new round needs rows of shards that
old ranks held, and every old shard is still in the memory of a survivor that held it.
:func:`transfers` is the plan (pure): which new rank sends which rows to which; a rank
that holds rows it needs takes them from itself. :func:`exchange` carries one tensor's
plan out in a single ``all_to_all_single``, so a rank holds at most its old shard, its
new one and one tensor's buffers at a time, and nobody ever holds a whole parameter it
does not own.

A DCP save at the old mesh and a load at the new one give the same rows (DCP reads the
same ``torch.chunk`` layout), which tests/integration/recovery/test_fsdp_in_place.py
checks bitwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that ``rank`` holds of a dim of ``rows`` sharded over
    ``world_size`` as ``torch.chunk`` (and so FSDP2 and DTensor's ``Shard(0)``) does."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    size = -(-rows // world_size) if rows else 0
    start = min(rows, rank * size)
    return start, min(rows, start + size)


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` of old shard ``old_shard`` that new rank ``source`` sends
    to new rank ``dest``."""

    source: int
    dest: int
    old_shard: int
    start: int
    stop: int


def transfers(
    rows: int,
    old_shards: int,
    new_world: int,
    holders: Mapping[int, int],
    new_shards: int | None = None,
    own: Mapping[int, int] | None = None,
) -> list[Transfer]:
    """Every move that takes a dim of ``rows`` cut into ``old_shards`` to a round of
    ``new_world`` ranks cut into ``new_shards`` (default: one a rank), new rank ``d``
    wanting shard ``d % new_shards``.

    ``holders`` maps each old shard to the new rank that sends its rows; ``own`` maps a
    new rank to the old shard it holds itself, which it takes from itself instead. Raises
    when an old shard whose rows are not empty has no holder (it is gone: the caller
    restores from elsewhere).
    """
    new_shards = new_world if new_shards is None else new_shards
    own = own or {}
    missing = [
        s
        for s in range(old_shards)
        if s not in holders
        and chunk_rows(rows, old_shards, s)[0] < chunk_rows(rows, old_shards, s)[1]
    ]
    if missing:
        raise ValueError(f"old shards {missing} have no holder in the new world")
    out = []
    for dest in range(new_world):
        want_start, want_stop = chunk_rows(rows, new_shards, dest % new_shards)
        for old_shard in range(old_shards):
            have_start, have_stop = chunk_rows(rows, old_shards, old_shard)
            start, stop = max(want_start, have_start), min(want_stop, have_stop)
            if start < stop:
                source = dest if own.get(dest) == old_shard else holders[old_shard]
                out.append(Transfer(source, dest, old_shard, start, stop))
    return out


def complete_holders(held: Sequence[tuple[int, int, int]], newest: int) -> dict[int, int] | None:
    """Which new rank sends each old shard (the lowest that holds it), or None when the
    survivors at step ``newest`` cannot rebuild the step (a shard lost with every rank
    that held it, or held at another step).

    ``held[new_rank] = (step, old_shard, old_shards)``, ``old_shard`` -1 for a rank that
    holds none (a joiner)."""
    at_newest = [
        (new, old, shards)
        for new, (step, old, shards) in enumerate(held)
        if old >= 0 and step == newest
    ]
    cuts = {shards for _, _, shards in at_newest}
    if len(cuts) != 1:
        return None
    (old_shards,) = cuts
    holders: dict[int, int] = {}
    for new, old, _ in at_newest:
        holders.setdefault(old, new)
    if sorted(holders) != list(range(old_shards)):
        return None
    return holders


def own_shards(held: Sequence[tuple[int, int, int]], newest: int) -> dict[int, int]:
    """New rank -> the old shard of step ``newest`` it holds itself."""
    return {new: old for new, (step, old, _) in enumerate(held) if old >= 0 and step == newest}


def old_shards_of(held: Sequence[tuple[int, int, int]], newest: int) -> int:
    """How many shards the state at step ``newest`` was cut into."""
    return next(shards for step, old, shards in held if old >= 0 and step == newest)


def exchange(
    held: Mapping[int, torch.Tensor],
    out: torch.Tensor,
    rows: int,
    old_shards: int,
    holders: Mapping[int, int],
    rank: int,
    new_world: int,
    new_shards: int | None = None,
    own: Mapping[int, int] | None = None,
    via: torch.device | None = None,
) -> None:
    """Fill ``out``, this rank's new shard of one tensor of ``rows`` rows; every rank
    calls it for the same tensor, in the same order.

    ``held`` maps each old shard this rank holds the rows of (its own, or a copy of a
    peer's: shard_copies.py) to those rows; ``holders``, ``new_shards`` and ``own`` are
    :func:`transfers`'. The rows it sends and receives go in one ``all_to_all_single``
    over the default group, on device ``via`` (the group's; default ``out``'s): a copy
    sits in CPU memory while the shard may be on a GPU, and a collective takes tensors
    of one device (found on a GPU: gloo refused a CPU copy sent into a CUDA shard)."""
    via = out.device if via is None else via
    row_numel = out[0].numel() if out.shape[0] else _row_numel(held.values())
    plan = transfers(rows, old_shards, new_world, holders, new_shards, own)
    send_counts, recv_counts = [0] * new_world, [0] * new_world
    pieces: list[torch.Tensor] = []
    # to each destination in old-shard order, as the receiver reads them
    for move in sorted((m for m in plan if m.source == rank), key=lambda m: (m.dest, m.old_shard)):
        local = held.get(move.old_shard)
        assert local is not None, "a rank with rows to send holds them"
        held_from = chunk_rows(rows, old_shards, move.old_shard)[0]
        send_counts[move.dest] += (move.stop - move.start) * row_numel
        pieces.append(local[move.start - held_from : move.stop - held_from].reshape(-1).to(via))
    receiving = sorted((m for m in plan if m.dest == rank), key=lambda m: (m.source, m.old_shard))
    for move in receiving:
        recv_counts[move.source] += (move.stop - move.start) * row_numel
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=out.dtype, device=via)
    received = torch.empty(sum(recv_counts), dtype=out.dtype, device=via)
    dist.all_to_all_single(received, send, recv_counts, send_counts)
    del send, pieces
    # pieces arrive in source-rank order, and from one source in old-shard order
    flat, offset = out.view(-1), 0
    cut = new_world if new_shards is None else new_shards
    first = chunk_rows(rows, cut, rank % cut)[0]
    for move in receiving:
        count = (move.stop - move.start) * row_numel
        at = (move.start - first) * row_numel
        flat[at : at + count].copy_(received[offset : offset + count])
        offset += count


def _row_numel(held: Iterable[torch.Tensor]) -> int:
    """Elements per row when this rank's new shard is empty (what it sends decides)."""
    for local in held:
        if local.dim() > 0 and local.shape[0] > 0:
            return local[0].numel()
    return 0
