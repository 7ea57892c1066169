"""Moving dim-0 shards between world sizes (training/reshard.py): the plan against
``torch.chunk``, and the exchange over real gloo processes against the rows each new rank
must hold; and each round's mesh of its own (fsdp_replication.round_dims)."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import on_ranks

from bench.ports import free_port
from elasticjob_runtime.training.reshard import (
    ShardMove,
    buckets,
    chunk_rows,
    complete_holders,
    exchange_all,
    old_shards_of,
    own_shards,
    transfers,
)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 16, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_a_rank_holds_the_rows_torch_chunk_gives_it(rows: int, world: int) -> None:
    chunks = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        start, stop = chunk_rows(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == expected


@pytest.mark.parametrize(
    ("rows", "old", "new", "holders"),
    [
        (17, 2, 3, {0: 1, 1: 2}),  # a joiner at rank 0
        (17, 3, 3, {0: 2, 1: 0, 2: 1}),  # every rank renumbered
        (5, 2, 4, {0: 3, 1: 0}),  # two joiners
        (3, 2, 5, {0: 0, 1: 4}),  # more ranks than rows: some hold nothing
    ],
)
def test_every_new_row_comes_once_from_the_rank_that_held_it(
    rows: int, old: int, new: int, holders: dict[int, int]
) -> None:
    received: dict[int, list[int]] = {dest: [] for dest in range(new)}
    for move in transfers(rows, old, new, holders):
        assert move.source == holders[move.old_shard]
        held = range(*chunk_rows(rows, old, move.old_shard))
        assert move.start in held and move.stop - 1 in held
        received[move.dest].extend(range(move.start, move.stop))
    for dest, got in received.items():
        assert sorted(got) == list(range(*chunk_rows(rows, new, dest)))


def test_a_shard_with_no_holder_cannot_be_moved() -> None:
    with pytest.raises(ValueError, match=r"old shards \[1\] have no holder"):
        transfers(8, 2, 2, {0: 0})
    # an old rank that held no row needs no holder (3 rows over 4 ranks: rank 3 is empty)
    assert transfers(3, 4, 1, {0: 0, 1: 0, 2: 0})


def test_the_survivors_rebuild_only_a_complete_step() -> None:
    # (step, old rank, old world) by new rank; a joiner holds nothing
    assert complete_holders([(12, 1, 2), (-1, -1, 0), (12, 0, 2)], 12) == {1: 0, 0: 2}
    assert old_shards_of([(12, 1, 2), (-1, -1, 0), (12, 0, 2)], 12) == 2
    # old rank 1's shard went with its process
    assert complete_holders([(12, 0, 2), (-1, -1, 0)], 12) is None
    # a rank one step behind holds another step's shard
    assert complete_holders([(12, 0, 2), (11, 1, 2)], 12) is None


@pytest.mark.parametrize(
    ("rows", "old", "new", "new_shards", "own"),
    [
        (11, 2, 4, 2, {0: 0, 1: 1}),  # HSDP 1 x 2 joined by a second replica: 2 x 2
        (11, 2, 3, 3, {0: 0, 1: 1, 2: 0}),  # 2 x 2 lost a rank: one group of 3
        (11, 3, 4, 2, {0: 0, 1: 1, 2: 2}),  # one group of 3 joined: 2 x 2
        (7, 2, 4, 2, {0: 0, 1: 1, 2: 0, 3: 1}),  # 2 x 2 again: nothing moves between ranks
    ],
)
def test_hsdp_every_replica_gets_its_rows_and_a_rank_takes_what_it_holds_from_itself(
    rows: int, old: int, new: int, new_shards: int, own: dict[int, int]
) -> None:
    holders = {shard: min(r for r, s in own.items() if s == shard) for shard in range(old)}
    received: dict[int, list[int]] = {dest: [] for dest in range(new)}
    for move in transfers(rows, old, new, holders, new_shards, own):
        expected = move.dest if own.get(move.dest) == move.old_shard else holders[move.old_shard]
        assert move.source == expected
        assert own.get(move.source) == move.old_shard  # it sends rows it holds
        received[move.dest].extend(range(move.start, move.stop))
    for dest, got in received.items():
        assert sorted(got) == list(range(*chunk_rows(rows, new_shards, dest % new_shards)))
    if own == dict(enumerate(s % new_shards for s in range(new))) and old == new_shards:
        plan = transfers(rows, old, new, holders, new_shards, own)
        assert all(m.source == m.dest for m in plan)


def test_replicas_of_a_shard_make_it_complete_and_the_lowest_sends_it() -> None:
    # 2 x 2 at step 12 lost new rank 1's peer of shard 1 in the first replica
    held = [(12, 0, 2), (12, 0, 2), (12, 1, 2), (-1, -1, 0)]
    assert complete_holders(held, 12) == {0: 0, 1: 2}
    assert own_shards(held, 12) == {0: 0, 1: 0, 2: 1}
    # every holder of shard 1 gone: the step cannot be rebuilt from memory
    assert complete_holders([(12, 0, 2), (12, 0, 2)], 12) is None


ROWS, COLS = 11, 3
WHOLE = torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS)


def _exchange(
    rank: int,
    port: int,
    out: Any,
    holders: dict[int, int],
    old: int,
    new_shards: int = 3,
    own: dict[int, int] | None = None,
) -> None:
    """New rank ``rank`` of 3: it holds the rows of each old shard ``holders`` maps to
    it, and of the one ``own`` says it holds."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    mine_old = {r for r, n in holders.items() if n == rank} | {
        s for r, s in (own or {}).items() if r == rank
    }
    held = {r: WHOLE[slice(*chunk_rows(ROWS, old, r))].clone() for r in mine_old}
    start, stop = chunk_rows(ROWS, new_shards, rank % new_shards)
    mine = torch.full((stop - start, COLS), float("nan"), dtype=torch.float64)
    exchange_all([ShardMove(held, mine, ROWS)], old, holders, rank, 3, new_shards, own)
    out.put((rank, mine.tolist()))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("old", "holders", "new_shards", "own"),
    [
        (2, {0: 2, 1: 0}, 3, None),
        (3, {0: 1, 1: 2, 2: 0}, 3, None),
        (4, {0: 0, 1: 0, 2: 1, 3: 2}, 3, None),
        (2, {0: 0, 1: 1}, 1, {0: 0, 1: 1, 2: 0}),
    ],
    ids=[
        "a joiner at rank 1, survivors renumbered",
        "same world, every rank moved",
        "a rank sends its own rows and a copy of a lost peer's",
        "HSDP: three replicas of one shard from two, each taking its own from itself",
    ],
)
def test_the_exchange_leaves_each_rank_exactly_its_new_rows(
    old: int, holders: dict[int, int], new_shards: int, own: dict[int, int] | None
) -> None:
    got = dict(on_ranks(_exchange, 3, holders, old, new_shards, own))
    for rank in range(3):
        assert got[rank] == WHOLE[slice(*chunk_rows(ROWS, new_shards, rank % new_shards))].tolist()


# tensors of three dtypes, one of them empty on some ranks, one 1-D (a bias)
MANY = {
    "a": WHOLE,
    "b": torch.arange(5 * 4, dtype=torch.int32).reshape(5, 4),
    "c": torch.arange(2, dtype=torch.float32) + 0.5,
    "d": torch.arange(7, dtype=torch.float32) * -1.0,
    "e": torch.arange(9 * 2, dtype=torch.bfloat16).reshape(9, 2),
}


def _exchange_all(rank: int, port: int, out: Any, holders: dict[int, int], old: int) -> None:
    """:func:`_exchange` for the tensors of :data:`MANY` in one call, in buckets of a
    few dozen bytes (so some hold several tensors and some one)."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    mine_old = {r for r, n in holders.items() if n == rank}
    moves = []
    for whole in MANY.values():
        rows = whole.shape[0]
        held = {r: whole[slice(*chunk_rows(rows, old, r))].clone() for r in mine_old}
        start, stop = chunk_rows(rows, 3, rank)
        mine = torch.full((stop - start, *whole.shape[1:]), -7, dtype=whole.dtype)
        moves.append(ShardMove(held, mine, rows))
    exchange_all(moves, old, holders, rank, 3, bucket_bytes=64)
    out.put((rank, [m.out.tolist() for m in moves]))
    dist.destroy_process_group()


def test_many_tensors_of_mixed_dtypes_move_together_in_buckets() -> None:
    holders = {0: 2, 1: 0}  # a joiner at rank 1, the survivors renumbered
    got = dict(on_ranks(_exchange_all, 3, holders, 2))
    for rank in range(3):
        want = [w[slice(*chunk_rows(w.shape[0], 3, rank))].tolist() for w in MANY.values()]
        assert got[rank] == want


def test_buckets_are_bounded_cut_at_each_dtype_and_hold_a_large_tensor_alone() -> None:
    f, i = torch.float32, torch.int32
    assert buckets([10, 10, 10, 10], [f] * 4, 25) == [range(0, 2), range(2, 4)]
    assert buckets([10, 100, 10], [f] * 3, 25) == [range(0, 1), range(1, 2), range(2, 3)]
    assert buckets([10, 10, 10], [f, i, i], 100) == [range(0, 1), range(1, 3)]
    assert buckets([], [], 10) == []


def _coordinates(index: int, ports: list[int], out: Any) -> None:
    """Two rounds in one process, its rank 0 then 1 (or 1 then 0): the mesh and the
    shards of each round's model say this round's rank."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticjob_runtime.training.fsdp_replication import round_dims

    for generation, port in enumerate(ports):
        rank = index if generation == 0 else 1 - index
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=round_dims(generation, hsdp=False))
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        weight = next(model.parameters())
        out.put((index, generation, rank, weight.device_mesh.get_coordinate()))  # type: ignore[attr-defined]
        dist.destroy_process_group()


def test_a_rank_that_moves_between_rounds_holds_its_new_ranks_rows() -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port(), free_port()]
    procs = [ctx.Process(target=_coordinates, args=(i, ports, out)) for i in range(2)]
    for proc in procs:
        proc.start()
    seen = [out.get(timeout=120) for _ in range(4)]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    for _index, _generation, rank, coordinate in seen:
        assert coordinate == [rank] or coordinate == (rank,)
