"""Moving dim-0 shards from one mesh to another, from the survivors' memory.

FSDP2 shards every parameter (and the optimizer's state of it) along dim 0 the way
``torch.chunk`` does: ``ceil(rows / shards)`` rows a shard, the last ones short or empty.
Pure FSDP cuts as many shards as there are ranks; HSDP cuts one per rank of a shard group
and every replica holds them all (mesh_shape.py: rank ``r`` holds shard ``r % shards``).
When the world changes in place, each rank of the new round needs rows of shards that
old ranks held, and every old shard is still in the memory of a survivor that held it.
:func:`transfers` is the plan (pure): which new rank sends which rows to which; a rank
that holds rows it needs takes them from itself. :func:`exchange_all` carries the plans
of many tensors out in a few ``all_to_all_single`` calls, in buckets of bounded size, so
a rank holds at most its old shard, its new one and one bucket's buffers at a time, and
nobody ever holds a whole parameter it does not own.

A DCP save at the old mesh and a load at the new one give the same rows (DCP reads the
same ``torch.chunk`` layout), which tests/integration/recovery/test_fsdp_in_place.py
checks bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class ShardMove:
    """One tensor of an :func:`exchange_all`: the rows of each old shard this rank holds
    of it (its own, or a copy of a peer's: shard_copies.py), and ``out``, this rank's new
    shard of it, of a tensor ``rows`` rows long, filled in place."""

    held: Mapping[int, torch.Tensor]
    out: torch.Tensor
    rows: int

    @property
    def row_numel(self) -> int:
        """Elements per row (the same on every rank: a shard's trailing dims)."""
        return math.prod(self.out.shape[1:]) if self.out.dim() > 1 else 1

    @property
    def nbytes(self) -> int:
        """The whole tensor's bytes (the same on every rank)."""
        return self.rows * self.row_numel * self.out.element_size()


# What one all-to-all carries at most, over all ranks (one tensor larger goes alone): a
# rank's send and receive buffers are about this over the world size each, so the
# reshard's peak stays near its old shard plus its new one.
BUCKET_BYTES = 64 * 2**20


def buckets(sizes: Sequence[int], kinds: Sequence[object], limit: int) -> list[range]:
    """Consecutive runs of tensors (by their ``sizes`` in bytes) of at most ``limit``
    bytes each, a tensor larger than ``limit`` alone, and a new run wherever the kind
    (the dtype) changes, so that each run's bytes read back as one dtype wherever they
    land: every rank cuts them alike."""
    out: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > limit or kinds[i] != kinds[start]):
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def exchange_all(
    moves: Sequence[ShardMove],
    old_shards: int,
    holders: Mapping[int, int],
    rank: int,
    new_world: int,
    new_shards: int | None = None,
    own: Mapping[int, int] | None = None,
    via: torch.device | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Fill each move's ``out``; every rank calls it with the same tensors in the same
    order. ``holders``, ``new_shards`` and ``own`` are :func:`transfers`'.

    The tensors go in buckets of about ``bucket_bytes`` (:func:`buckets`), each one
    ``all_to_all_single`` of their bytes over the default group: one collective a tensor
    took 0.52-0.74 s to move a 29M-parameter GPT and its AdamW state (303 tensors) from
    two ranks to three on two cores, in buckets 0.15-0.24 s. They travel on device
    ``via`` (the group's; default the first ``out``'s): a copy sits in CPU memory while
    the shard may be on a GPU, and a collective takes tensors of one device (found on a
    GPU: gloo refused a CPU copy sent into a CUDA shard)."""
    if not moves:
        return
    via = moves[0].out.device if via is None else via
    for run in buckets([m.nbytes for m in moves], [m.out.dtype for m in moves], bucket_bytes):
        _exchange_bucket(
            [moves[i] for i in run], old_shards, holders, rank, new_world, new_shards, own, via
        )


def _exchange_bucket(
    moves: Sequence[ShardMove],
    old_shards: int,
    holders: Mapping[int, int],
    rank: int,
    new_world: int,
    new_shards: int | None,
    own: Mapping[int, int] | None,
    via: torch.device,
) -> None:
    """One all-to-all for ``moves``: to each destination, tensor by tensor, each tensor's
    rows in old-shard order, as the bytes they are; the receiver reads them the same way."""
    send_counts, recv_counts = [0] * new_world, [0] * new_world
    sends: list[list[torch.Tensor]] = [[] for _ in range(new_world)]
    receiving: list[list[tuple[ShardMove, Transfer]]] = [[] for _ in range(new_world)]
    cut = new_world if new_shards is None else new_shards
    for move in moves:
        width = move.row_numel * move.out.element_size()
        plan = transfers(move.rows, old_shards, new_world, holders, new_shards, own)
        for t in sorted((t for t in plan if t.source == rank), key=lambda t: t.old_shard):
            local = move.held.get(t.old_shard)
            assert local is not None, "a rank with rows to send holds them"
            held_from = chunk_rows(move.rows, old_shards, t.old_shard)[0]
            rows = local[t.start - held_from : t.stop - held_from].contiguous()
            sends[t.dest].append(rows.reshape(-1).view(torch.uint8).to(via))
            send_counts[t.dest] += (t.stop - t.start) * width
        for t in sorted((t for t in plan if t.dest == rank), key=lambda t: t.old_shard):
            receiving[t.source].append((move, t))
            recv_counts[t.source] += (t.stop - t.start) * width
    pieces = [piece for dest in sends for piece in dest]
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=via)
    del pieces, sends
    received = torch.empty(sum(recv_counts), dtype=torch.uint8, device=via)
    dist.all_to_all_single(received, send, recv_counts, send_counts)
    del send
    # from each source in turn: tensor by tensor, each in old-shard order
    offset = 0
    for source in range(new_world):
        for move, t in receiving[source]:
            out = move.out
            count = (t.stop - t.start) * move.row_numel
            nbytes = count * out.element_size()
            first = chunk_rows(move.rows, cut, rank % cut)[0]
            at = (t.start - first) * move.row_numel
            piece = received[offset : offset + nbytes].view(out.dtype)
            out.view(-1)[at : at + count].copy_(piece)
            offset += nbytes
