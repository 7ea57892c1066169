"""Sharded checkpoints written in the background (checkpoints/sharded.py), over real gloo
processes: the save returns before any file is written, training may change the state
at once, and what is committed is bitwise what DCP's own save of that step loads; a
save one rank could not write is never committed, and goes at the next commit."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import on_ranks

from elasticjob_runtime.checkpoints.format import serialize
from elasticjob_runtime.checkpoints.sharded import (
    ShardedCheckpoints,
    committed_sharded_steps,
    sharded_name,
)

ROWS, COLS = 7, 3  # uneven: rank 1 holds fewer rows
WHOLE = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _join(rank: int, port: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    return init_device_mesh("cpu", (2,))


def _state(mesh: Any, scale: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "model": {"w": distribute_tensor(WHOLE * scale, mesh, [Shard(0)])},
        "optim": {"w": {"exp_avg": distribute_tensor(WHOLE + scale, mesh, [Shard(0)])}},
    }


def _full(state: dict[str, Any]) -> dict[str, list[Any]]:
    return {
        "w": state["model"]["w"].full_tensor().tolist(),
        "exp_avg": state["optim"]["w"]["exp_avg"].full_tensor().tolist(),
    }


def _save_in_background(rank: int, port: int, out: Any, directory: str) -> None:
    from torch.distributed.checkpoint import load, save

    from elasticjob_runtime.checkpoints import dcp_parts

    mesh = _join(rank, port)
    gate = threading.Event()  # holds this rank's write until the save has returned
    write = dcp_parts.SaveParts.write

    def held_write(self: Any, plan: Any) -> Any:
        gate.wait()
        return write(self, plan)

    dcp_parts.SaveParts.write = held_write  # type: ignore[method-assign]
    checkpoints = ShardedCheckpoints(Path(directory), keep=2, background=True)
    live = _state(mesh, 2.0)
    at_save = _full(live)
    save(_state(mesh, 2.0), checkpoint_id=Path(directory) / "dcp-reference")
    checkpoints.save(5, live, serialize({"step": 5}))
    returned_uncommitted = committed_sharded_steps(Path(directory)) == []
    for tensor in (live["model"]["w"], live["optim"]["w"]["exp_avg"]):
        tensor.to_local().add_(1000.0)  # training goes on at once
    gate.set()
    checkpoints.close()
    committed = committed_sharded_steps(Path(directory))

    ours, reference = _state(mesh, 0.0), _state(mesh, 0.0)
    replicated = checkpoints.load(5, ours)
    load(reference, checkpoint_id=Path(directory) / "dcp-reference")
    out.put(
        (rank, returned_uncommitted, committed, replicated, at_save, _full(ours), _full(reference))
    )
    dist.destroy_process_group()


def _on_two_ranks(target: Any, directory: Path) -> dict[int, Any]:
    """``target(rank, port, out, directory)`` on two ranks; what each put, by rank."""
    return {r[0]: r[1:] for r in on_ranks(target, 2, str(directory))}


def test_a_background_save_commits_what_dcp_itself_saves_of_that_step(tmp_path: Path) -> None:
    got = _on_two_ranks(_save_in_background, tmp_path)
    for rank in range(2):
        returned_uncommitted, committed, replicated, at_save, ours, reference = got[rank]
        assert returned_uncommitted, "the save waited for its writes"
        assert committed == [5]
        assert replicated == {"step": 5}
        assert ours == at_save == reference  # not the +1000 training made after the save
    # a DCP checkpoint like any: one process loads it whole, at another world size
    from torch.distributed.checkpoint import load

    whole = {"model": {"w": torch.zeros(ROWS, COLS)}}
    with pytest.warns(UserWarning, match="load in a single process"):
        load(whole, checkpoint_id=tmp_path / sharded_name(5), no_dist=True)
    assert torch.equal(whole["model"]["w"], WHOLE * 2.0)
    assert (
        sorted(p.name for p in (tmp_path / sharded_name(5)).iterdir() if "written" in p.name) == []
    )


def _one_part_fails(rank: int, port: int, out: Any, directory: str) -> None:
    from elasticjob_runtime.checkpoints import dcp_parts

    mesh = _join(rank, port)
    write = dcp_parts.SaveParts.write
    checkpoints = ShardedCheckpoints(Path(directory), keep=2, background=True)
    if rank == 1:

        def full_disk(self: Any, plan: Any) -> Any:
            raise OSError(28, "No space left on device")

        dcp_parts.SaveParts.write = full_disk  # type: ignore[method-assign]
    checkpoints.save(5, _state(mesh, 1.0), serialize({"step": 5}))
    checkpoints.wait_own_part()
    dcp_parts.SaveParts.write = write  # type: ignore[method-assign]
    checkpoints.save(10, _state(mesh, 3.0), serialize({"step": 10}))
    checkpoints.close()
    newest = checkpoints.newest_step(torch.device("cpu"))
    loaded = _state(mesh, 0.0)
    checkpoints.load(newest, loaded)
    out.put((rank, committed_sharded_steps(Path(directory)), newest, _full(loaded)))
    dist.destroy_process_group()


def test_a_save_one_rank_could_not_write_is_never_committed(tmp_path: Path) -> None:
    got = _on_two_ranks(_one_part_fails, tmp_path)
    for rank in range(2):
        committed, newest, loaded = got[rank]
        assert committed == [10] and newest == 10
        assert loaded["w"] == (WHOLE * 3.0).tolist()
    assert [p.name for p in tmp_path.iterdir()] == [sharded_name(10)]  # step 5's part removed
