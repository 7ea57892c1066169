"""shard_copies: which step a group can go back to from the copies (the rule, by hand),
a snapshot's buffers and views, and the swap with the buddy over real gloo processes."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import on_ranks

from bench.ports import free_port
from elasticjob_runtime.training.reshard import chunk_rows
from elasticjob_runtime.training.shard_copies import (
    NO_COPIES,
    CopyHolding,
    Rollback,
    buddy_of,
    copy_holders,
    numel_by_dtype,
    swap_with_buddy,
    take,
)


def test_the_buddy_is_the_next_rank_round_the_ring() -> None:
    assert [buddy_of(r, 3) for r in range(3)] == [1, 2, 0]


def test_a_lost_rank_is_rebuilt_from_the_copy_its_buddy_keeps() -> None:
    # old world 3 at step 20: old rank 1 died; rank 2 (now new rank 1) keeps its copy
    held = [CopyHolding(20, 3, 0, 2), CopyHolding(20, 3, 2, 1)]
    assert copy_holders(held) == Rollback(20, 3, {0: 0, 2: 1, 1: 1}, 0)
    # a joiner holds nothing and changes nothing
    assert copy_holders([*held, NO_COPIES]) == Rollback(20, 3, {0: 0, 2: 1, 1: 1}, 0)


def test_two_neighbours_lost_together_leave_no_step_whole() -> None:
    # old world 3: ranks 1 and 2 died, rank 0 keeps only rank 2's copy
    assert copy_holders([CopyHolding(20, 3, 0, 2)]) is None
    assert copy_holders([NO_COPIES, NO_COPIES]) is None


def test_own_snapshots_are_preferred_and_copies_of_two_steps_never_mix() -> None:
    # every rank alive at the copy: each sends its own rows
    held = [CopyHolding(10, 2, 0, 1), CopyHolding(10, 2, 1, 0)]
    assert copy_holders(held) == Rollback(10, 2, {0: 0, 1: 1}, 0)
    # rank 0 got rank 1's copy at 20 before rank 1's swap broke: 20 is whole on rank 0
    assert copy_holders([CopyHolding(20, 2, 0, 1), CopyHolding(10, 2, 1, 0)]) == Rollback(
        20, 2, {0: 0, 1: 0}, 0
    )
    # world 3, old rank 2 lost: step 20 lacks rank 1's rows, step 10 lacks rank 2's
    assert copy_holders([CopyHolding(20, 3, 0, 2), CopyHolding(10, 3, 1, 0)]) is None
    # the same step cut for two worlds (two rounds) is not one step's shards
    assert copy_holders([CopyHolding(20, 2, 0, 1), CopyHolding(20, 3, 1, 0)]) is None
    # only copies, no own snapshot: no rank can send the replicated state
    assert copy_holders([CopyHolding(20, 2, -1, 0), CopyHolding(20, 2, -1, 1)]) is None


def test_a_snapshot_copies_its_rows_into_one_buffer_per_dtype() -> None:
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # rank 1 of 2: rows 4..7
    count = torch.arange(4, dtype=torch.int64)
    snap = take(7, 1, 2, {"model/w": (weight, 8), "optim/w/n": (count, 8)}, b"r")
    weight.zero_()  # training goes on: the snapshot keeps step 7's rows
    assert snap.tensors()["model/w"].tolist() == torch.arange(12.0).reshape(4, 3).tolist()
    assert snap.tensors()["optim/w/n"].tolist() == [0, 1, 2, 3]
    assert set(snap.flats) == {torch.float32, torch.int64}
    assert numel_by_dtype(snap.layout, 2, 1) == {torch.float32: 12, torch.int64: 4}
    # 8 rows over 3 ranks: 3, 3, 2 (torch.chunk)
    assert numel_by_dtype(snap.layout, 3, 2) == {torch.float32: 6, torch.int64: 2}


def test_the_next_snapshot_goes_into_the_last_ones_buffers_when_they_fit() -> None:
    rows = torch.ones(4, 3)
    first = take(10, 1, 2, {"model/w": (rows, 8)}, b"")
    rows.fill_(2.0)
    second = take(20, 1, 2, {"model/w": (rows, 8)}, b"", reuse=first)
    assert second.flats[torch.float32].data_ptr() == first.flats[torch.float32].data_ptr()
    assert second.step == 20 and second.tensors()["model/w"].eq(2.0).all()
    # another world (a new round) cuts other rows: new buffers
    third = take(30, 0, 3, {"model/w": (rows[:3], 8)}, b"", reuse=second)
    assert third.flats[torch.float32].data_ptr() != second.flats[torch.float32].data_ptr()


ROWS = 7  # over 3 ranks: 3, 3, 1 rows


def _whole() -> torch.Tensor:
    return torch.arange(ROWS * 2, dtype=torch.float64).reshape(ROWS, 2)


def _swap(rank: int, port: int, out: Any) -> None:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    mine = _whole()[slice(*chunk_rows(ROWS, 3, rank))]
    own = take(5, rank, 3, {"model/w": (mine, ROWS)}, b"")
    first = swap_with_buddy(own, torch.device("cpu"))
    again = take(6, rank, 3, {"model/w": (mine * 2, ROWS)}, b"", reuse=own)
    theirs = swap_with_buddy(again, torch.device("cpu"), reuse=first)  # into first's buffer
    assert theirs.flats[torch.float64].data_ptr() == first.flats[torch.float64].data_ptr()
    rows = (theirs.tensors()["model/w"] / 2).tolist()
    out.put((rank, theirs.rank, theirs.step, rows))
    dist.destroy_process_group()


def test_each_rank_keeps_exactly_its_predecessors_rows() -> None:
    got = {rank: rest for rank, *rest in on_ranks(_swap, 3)}
    for rank in range(3):
        before = (rank - 1) % 3
        expected = _whole()[slice(*chunk_rows(ROWS, 3, before))].tolist()
        assert got[rank] == [before, 6, expected]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_of_a_round_has_a_buddy_that_is_not_itself(world: int) -> None:
    assert all(buddy_of(r, world) != r for r in range(world))


def _wait_for_a_peer_that_never_sends(rank: int, port: int, out: Any) -> None:
    import time

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 1:  # in the group, never in the swap: rank 0's all-to-all never completes
        store.wait(["done"], timedelta(seconds=60))
        return
    own = take(5, 0, 2, {"model/w": (_whole()[:3], ROWS)}, b"")
    given_up = time.monotonic() + 0.5
    try:
        swap_with_buddy(own, torch.device("cpu"), abandoned=lambda: time.monotonic() > given_up)
        out.put("completed")
    except dist.DistError as exc:
        out.put(f"raised: {exc}")
    store.set("done", "1")


def test_a_swap_whose_round_was_abandoned_stops_waiting_for_its_peer() -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_wait_for_a_peer_that_never_sends, args=(r, port, out)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    said = out.get(timeout=60)
    for proc in procs:
        proc.join(timeout=60)
    assert said.startswith("raised: the round was abandoned"), said
