"""DCP's save taken apart, through its public planner and storage-writer interfaces.

``dcp.save`` plans, writes and finishes in one call, with collectives between the
parts. Run in a background thread, those collectives would race the training thread's
on the same group, and a regroup would strand them. Taken apart, the planning runs on
the training thread (its collectives on the round's group, with the step's), the
writing needs none, and the finish needs only every rank's write results, which
:mod:`elasticjob_runtime.checkpoints.sharded` passes through files. The calls are the
ones ``dcp.save`` makes, in its order, on ``SavePlanner`` and ``StorageWriter``.

:func:`stage` is the CPU copy a background write reads while training goes on.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor


def laid_out_as(template: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as this rank's rows of a DTensor laid out as ``template`` (its mesh,
    placements, global shape and stride), with no op on the mesh."""
    return DTensor.from_local(
        local,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


def stage(state: Mapping[str, Any], buffers: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``state`` (nested dicts of DTensors) whose local shards are this
    process's own, taken into ``buffers`` (the last copy) where the shapes still match."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        old = buffers.get(key) if buffers is not None else None
        if isinstance(value, Mapping):
            out[key] = stage(value, old if isinstance(old, dict) else None)
        elif isinstance(value, DTensor):
            local = value.to_local()
            held = old.to_local() if isinstance(old, DTensor) else None
            if held is not None and held.shape == local.shape and held.dtype == local.dtype:
                held.copy_(local)
            else:
                held = local.detach().clone()
            out[key] = laid_out_as(value, held)
        else:
            raise TypeError(f"{key}: only DTensors are staged here, got {type(value).__name__}")
    return out


class SaveParts:
    """One save's planner and writer, on one rank."""

    def __init__(self, state: dict[str, Any], path: Path, rank: int, coordinator: bool) -> None:
        self.planner: SavePlanner = DefaultSavePlanner()
        self.writer = FileSystemWriter(path)
        self.planner.set_up_planner(
            state_dict=state, storage_meta=self.writer.storage_meta(), is_coordinator=coordinator
        )
        if "kwargs" in inspect.signature(self.writer.set_up_storage_writer).parameters:
            self.writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        else:
            self.writer.set_up_storage_writer(coordinator)

    def local_plan(self) -> SavePlan:
        """What this rank would write (training thread)."""
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def global_plan(self, plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Rank 0: every rank's final part, and the checkpoint's metadata."""
        plans, metadata = self.planner.create_global_plan(plans)
        return self.writer.prepare_global_plan(plans), metadata

    def write(self, plan: SavePlan) -> list[WriteResult]:
        """This rank's part, written (no collective: a background thread's work)."""
        writes = self.writer.write_data(self.planner.finish_plan(plan), self.planner)
        writes.wait()
        return list(writes.value())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: the metadata file, once every rank's part is written."""
        self.writer.finish(metadata=metadata, results=results)
