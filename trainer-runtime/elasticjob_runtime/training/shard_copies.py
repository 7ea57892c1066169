"""A copy of each rank's shards in a peer's memory, so that a lost rank costs no disk read.

Pure FSDP keeps one copy of each shard: a rank that dies takes its rows with it, and
without more the survivors can only read the newest DCP checkpoint. So every
``copy_every`` steps (steps that are multiples of it) every rank takes a
:class:`Snapshot` of its shards (the parameters' rows and the optimizer state's) and of
the replicated state, keeps it, and sends the shards to its *buddy*, the next rank of the
round, which keeps them beside its own (:func:`swap_with_buddy`). When a regroup finds a
shard of the newest step lost, the group rolls back to the newest step whose every shard
a survivor holds, its own or a copy (:func:`copy_holders`), and the shards move from
there to their new owners as in reshard.py. Only when two neighbours die together is the
checkpoint read.

A rank that leaves the job announced (its node drained, its pod deleted) trains a last
step with the others, which they agreed to switch after; at its end every rank takes a
copy out of turn, so the leaver's shard of that very step reaches its buddy and its
departure costs no step (fsdp_replication.someone_leaves), even with ``copy_every=0``.

A new round takes no copy of its own before its first multiple of ``copy_every``: the
copies of an earlier round stay valid (a rollback reshards from the world they were cut
for), and a copy at a round's first step cost 0.3 s of every regroup on the bench's
model. Until then a rank that joined or restarted holds none, so losing it together with
a neighbour that holds the copies reads the checkpoint, as two neighbours lost do.

Cost: two shards' worth of memory more on each rank (its snapshot and its predecessor's),
and every ``copy_every`` steps one memory copy of the shards and one send of them to the
buddy, on the training thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elasticjob_runtime.training.reshard import chunk_rows


@dataclass(frozen=True)
class Piece:
    """One sharded tensor of a snapshot: its name, dtype, rows over the whole world
    (dim 0, cut as ``torch.chunk`` cuts it) and the shape of one row."""

    name: str
    dtype: torch.dtype
    rows: int
    row_shape: tuple[int, ...]


@dataclass
class Snapshot:
    """The rows old rank ``rank`` of a ``world``-rank round held of each piece at
    ``step``, in one flat buffer per dtype; ``replicated`` (serialized) only in a rank's
    own snapshot."""

    step: int
    rank: int
    world: int
    layout: tuple[Piece, ...]
    flats: dict[torch.dtype, torch.Tensor]
    replicated: bytes = b""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each piece's rows, by name: views into the flat buffers."""
        out, offsets = {}, dict.fromkeys(self.flats, 0)
        for piece, (start, stop) in zip(self.layout, self._extents(), strict=True):
            count = (stop - start) * math.prod(piece.row_shape)
            at = offsets[piece.dtype]
            flat = self.flats[piece.dtype][at : at + count]
            out[piece.name] = flat.view(stop - start, *piece.row_shape)
            offsets[piece.dtype] = at + count
        return out

    def _extents(self) -> list[tuple[int, int]]:
        return [chunk_rows(piece.rows, self.world, self.rank) for piece in self.layout]


def numel_by_dtype(layout: Sequence[Piece], world: int, rank: int) -> dict[torch.dtype, int]:
    """How many elements of each dtype old rank ``rank`` holds of ``layout``."""
    out: dict[torch.dtype, int] = {}
    for piece in layout:
        start, stop = chunk_rows(piece.rows, world, rank)
        out[piece.dtype] = out.get(piece.dtype, 0) + (stop - start) * math.prod(piece.row_shape)
    return out


def reusable(old: Snapshot | None, layout: tuple[Piece, ...], world: int, rank: int) -> bool:
    """Can ``old``'s buffers take a snapshot of ``layout`` held by ``rank`` of ``world``?
    Reusing them spares a shard-sized allocation (and its page faults) at every copy."""
    return old is not None and (old.layout, old.world, old.rank) == (layout, world, rank)


def take(
    step: int,
    rank: int,
    world: int,
    pieces: Mapping[str, tuple[torch.Tensor, int]],
    replicated: bytes,
    reuse: Snapshot | None = None,
) -> Snapshot:
    """A snapshot of ``pieces`` (name -> (this rank's rows, rows over the world)), copied
    into one buffer per dtype, ``reuse``'s when its layout fits: the training that goes
    on does not touch it."""
    layout = tuple(
        Piece(name, local.dtype, rows, tuple(local.shape[1:]))
        for name, (local, rows) in sorted(pieces.items())
    )
    flats = {}
    for dtype in dict.fromkeys(p.dtype for p in layout):
        parts = [pieces[p.name][0].detach().reshape(-1) for p in layout if p.dtype == dtype]
        if reuse is not None and reusable(reuse, layout, world, rank) and parts[0].is_cpu:
            flats[dtype] = torch.cat(parts, out=reuse.flats[dtype])
        else:  # cat copies; on a GPU, .cpu() then moves the copy to host memory
            flats[dtype] = torch.cat(parts).cpu()
    return Snapshot(step, rank, world, layout, flats, replicated)


def buddy_of(rank: int, world: int) -> int:
    """The rank that keeps a copy of ``rank``'s shards: the next one, round the ring."""
    return (rank + 1) % world


def swap_with_buddy(
    own: Snapshot,
    device: torch.device,
    reuse: Snapshot | None = None,
    abandoned: Callable[[], bool] = lambda: False,
) -> Snapshot:
    """Send ``own``'s shards to this rank's buddy and receive its predecessor's (into
    ``reuse``'s buffers when they fit); every rank of the round calls it. Returns the
    predecessor's snapshot (its rows, no replicated state). The layout is the same on
    every rank, so only the rows travel.

    It waits for its all-to-all only while the round stands (``abandoned``: the worker
    gave the round up, worker_rounds.abandons): a peer killed while this rank took its
    snapshot left gloo's all-to-all waiting for ever (seen twice in 18 bench runs, the
    process group's threads gone), and the regroup waited with it."""
    rank, world = own.rank, own.world
    before = (rank - 1) % world
    theirs = numel_by_dtype(own.layout, world, before)
    into = reuse if reusable(reuse, own.layout, world, before) and device.type == "cpu" else None
    flats = {}
    for dtype, flat in own.flats.items():
        send_counts, recv_counts = [0] * world, [0] * world
        send_counts[buddy_of(rank, world)] = flat.numel()
        recv_counts[before] = theirs[dtype]
        received = (
            into.flats[dtype]
            if into is not None
            else torch.empty(theirs[dtype], dtype=dtype, device=device)
        )
        work = dist.all_to_all_single(
            received, flat.to(device), recv_counts, send_counts, async_op=True
        )
        wait_while_standing(work, abandoned)
        flats[dtype] = received.to("cpu")
    return Snapshot(own.step, before, world, own.layout, flats)


def wait_while_standing(work: Any, abandoned: Callable[[], bool], poll: float = 0.002) -> None:
    """``work.wait()``, or a ``DistError`` once the round is ``abandoned`` first."""
    while not work.is_completed():
        if abandoned():
            raise dist.DistError("the round was abandoned while a shard copy waited for a peer")
        time.sleep(poll)
    work.wait()  # raises what the collective raised


@dataclass(frozen=True)
class CopyHolding:
    """What one rank holds of the copies, as it reports it when a round forms."""

    step: int  # -1: no copies
    world: int  # the round the copies were cut for
    own: int  # the old rank its own snapshot is of (-1: none)
    buddy: int  # the old rank whose copy it keeps (-1: none)

    def row(self) -> list[int]:
        return [self.step, self.world, self.own, self.buddy]


NO_COPIES = CopyHolding(-1, 0, -1, -1)


@dataclass(frozen=True)
class Rollback:
    """The newest step the group can rebuild from copies: which new rank sends each old
    rank's rows, and which one sends the replicated state (one holding its own snapshot)."""

    step: int
    world: int
    holders: dict[int, int]
    source: int


def copy_holders(held: Sequence[CopyHolding]) -> Rollback | None:
    """The newest step whose every shard some rank of the new round holds (``held`` by
    new rank), or None. A rank's own snapshot is preferred to a copy of it."""
    for step in sorted({h.step for h in held if h.step >= 0}, reverse=True):
        at = [(new, h) for new, h in enumerate(held) if h.step == step]
        worlds = {h.world for _, h in at}
        if len(worlds) != 1:
            continue  # two rounds' copies of one step: never mixed
        (world,) = worlds
        holders: dict[int, int] = {}
        for new, h in at:
            if h.own >= 0:
                holders.setdefault(h.own, new)
        for new, h in at:
            if h.buddy >= 0:
                holders.setdefault(h.buddy, new)
        owners = [new for new, h in at if h.own >= 0]
        if sorted(holders) == list(range(world)) and owners:
            return Rollback(step, world, holders, min(owners))
    return None
