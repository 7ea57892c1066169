"""Moving dim-0 shards from one world size to another, from the survivors' memory.

FSDP2 shards every parameter (and the optimizer's state of it) along dim 0 the way
``torch.chunk`` does: ``ceil(rows / world)`` rows a rank, the last ranks short or empty.
When the world changes in place, each rank of the new round needs rows that old ranks
held; every old rank's rows are still in the memory of the survivor that was that rank.
:func:`transfers` is the plan (pure): which new rank sends which rows to which.
:func:`exchange` carries one tensor's plan out in a single ``all_to_all_single``, so a
rank holds at most its old shard, its new one and one tensor's buffers at a time, and
nobody ever holds a whole parameter it does not own.

A DCP save at the old world and a load at the new one give the same rows (DCP reads
the same ``torch.chunk`` layout), which tests/integration/recovery/test_fsdp_in_place.py
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
    """Rows ``[start, stop)`` that new rank ``source`` (which was old rank ``old_rank``)
    sends to new rank ``dest``."""

    source: int
    dest: int
    old_rank: int
    start: int
    stop: int


def transfers(
    rows: int, old_world: int, new_world: int, holders: Mapping[int, int]
) -> list[Transfer]:
    """Every move that takes a dim of ``rows`` from ``old_world`` shards to ``new_world``.

    ``holders`` maps each old rank to the new rank that holds its rows; a rank that
    already holds rows it keeps sends them to itself. Raises when an old rank whose rows
    are not empty has no holder (its shard is gone: the caller restores from elsewhere).
    """
    missing = [
        r
        for r in range(old_world)
        if r not in holders
        and chunk_rows(rows, old_world, r)[0] < chunk_rows(rows, old_world, r)[1]
    ]
    if missing:
        raise ValueError(f"old ranks {missing} have no holder in the new world")
    out = []
    for dest in range(new_world):
        want_start, want_stop = chunk_rows(rows, new_world, dest)
        for old_rank in range(old_world):
            have_start, have_stop = chunk_rows(rows, old_world, old_rank)
            start, stop = max(want_start, have_start), min(want_stop, have_stop)
            if start < stop:
                out.append(Transfer(holders[old_rank], dest, old_rank, start, stop))
    return out


def complete_holders(held: Sequence[tuple[int, int, int]], newest: int) -> dict[int, int] | None:
    """Which new rank holds each old rank's shard, or None when the survivors at step
    ``newest`` cannot rebuild it (a shard lost with its rank, or held at another step).

    ``held[new_rank] = (step, old_rank, old_world)``, ``old_rank`` -1 for a rank that
    holds no shard (a joiner)."""
    at_newest = [
        (new, old, world)
        for new, (step, old, world) in enumerate(held)
        if old >= 0 and step == newest
    ]
    worlds = {world for _, _, world in at_newest}
    if len(worlds) != 1:
        return None
    (old_world,) = worlds
    holders = {old: new for new, old, _ in at_newest}
    if sorted(holders) != list(range(old_world)):
        return None
    return holders


def old_world_of(held: Sequence[tuple[int, int, int]], newest: int) -> int:
    """The world size the shards at step ``newest`` were cut for."""
    return next(world for step, old, world in held if old >= 0 and step == newest)


def exchange(
    held: Mapping[int, torch.Tensor],
    out: torch.Tensor,
    rows: int,
    old_world: int,
    holders: Mapping[int, int],
    rank: int,
    new_world: int,
) -> None:
    """Fill ``out``, this rank's new shard of one tensor of ``rows`` rows; every rank
    calls it for the same tensor, in the same order.

    ``held`` maps each old rank this rank holds the rows of (its own, or a copy of a
    peer's: shard_copies.py) to those rows; ``holders`` says which new rank sends each
    old rank's rows. The rows it sends and receives go in one ``all_to_all_single`` over
    the default group."""
    row_numel = out[0].numel() if out.shape[0] else _row_numel(held.values())
    plan = transfers(rows, old_world, new_world, holders)
    send_counts, recv_counts = [0] * new_world, [0] * new_world
    pieces: list[torch.Tensor] = []
    # to each destination in old-rank order, as the receiver reads them
    for move in sorted((m for m in plan if m.source == rank), key=lambda m: (m.dest, m.old_rank)):
        local = held.get(move.old_rank)
        assert local is not None, "a rank with rows to send holds them"
        held_from = chunk_rows(rows, old_world, move.old_rank)[0]
        send_counts[move.dest] += (move.stop - move.start) * row_numel
        pieces.append(local[move.start - held_from : move.stop - held_from].reshape(-1))
    receiving = sorted((m for m in plan if m.dest == rank), key=lambda m: (m.source, m.old_rank))
    for move in receiving:
        recv_counts[move.source] += (move.stop - move.start) * row_numel
    send = torch.cat(pieces) if pieces else out.new_empty(0)
    received = out.new_empty(sum(recv_counts))
    dist.all_to_all_single(received, send, recv_counts, send_counts)
    del send, pieces
    # pieces arrive in source-rank order, and from one source in old-rank order
    flat, offset = out.view(-1), 0
    first = chunk_rows(rows, new_world, rank)[0]
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
