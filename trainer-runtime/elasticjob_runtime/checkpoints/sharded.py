"""Checkpoints of sharded state: torch.distributed.checkpoint (DCP), committed by a rename.

Every rank writes its own shards (``dcp.save``), so no rank ever holds the whole model;
DCP's metadata records the global layout, so a checkpoint restores at any world size
(``dcp.load`` reads each rank's new rows). A save goes to ``sharded-<step>.partial/``;
once ``dcp.save`` returns on rank 0 (DCP's coordinator, which writes the metadata only
after every rank's files are written), rank 0 adds the replicated state (sampler,
counters, schedulers: one ``torch.save`` file, loaded as data only) and renames the
directory to ``sharded-<step>/``: a directory with that name is a complete checkpoint,
one still ``.partial`` a save that did not finish. The last ``keep`` stay.

The directory must be one every rank reaches (the manifest's shared volume): each rank
writes its own files into it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticjob_runtime.checkpoints.files import write_atomic
from elasticjob_runtime.checkpoints.format import deserialize

log = logging.getLogger(__name__)

_NAME = re.compile(r"^sharded-(\d{10})$")
REPLICATED = "replicated.pt"


def sharded_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"sharded-{step:010d}"


def committed_sharded_steps(directory: Path) -> list[int]:
    """Steps with a complete sharded checkpoint in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        if match and (directory / name / REPLICATED).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def _agreed_step(directory: Path, device: torch.device) -> int:
    """Rank 0's newest committed step (-1 for none), on every rank."""
    steps = committed_sharded_steps(directory) if dist.get_rank() == 0 else []
    newest = torch.tensor([steps[-1] if steps else -1], dtype=torch.int64, device=device)
    dist.broadcast(newest, 0)
    return int(newest.item())


class ShardedCheckpoints:
    """Save and restore a sharded state dict with DCP (see the module docstring)."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = directory
        self.keep = keep
        self.saved_step: int | None = None

    def save(self, step: int, sharded: dict[str, Any], replicated: bytes) -> None:
        """Every rank calls it with its own ``sharded`` state dict (DTensors) and the same
        ``replicated`` bytes; rank 0 commits."""
        from torch.distributed.checkpoint.state_dict_saver import save

        final = self.directory / sharded_name(step)
        partial = final.with_name(final.name + ".partial")
        if dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save that did not finish
        dist.barrier()
        save(sharded, checkpoint_id=partial)
        if dist.get_rank() == 0:
            write_atomic(partial, REPLICATED, replicated)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            self._prune(step)
        self.saved_step = step

    def _prune(self, newest: int) -> None:
        for step in committed_sharded_steps(self.directory)[: -self.keep]:
            if step != newest:
                shutil.rmtree(self.directory / sharded_name(step), ignore_errors=True)

    def newest_step(self, device: torch.device) -> int:
        """The newest complete checkpoint's step as rank 0 sees it (-1: none), on every
        rank (they must load the same one)."""
        return _agreed_step(self.directory, device)

    def load(self, step: int, sharded: dict[str, Any]) -> dict[str, Any]:
        """Load checkpoint ``step``'s shards into ``sharded`` (in place: DTensors of this
        round's layout, which DCP fills with their rows) and return its replicated
        state. Every rank calls it."""
        from torch.distributed.checkpoint.state_dict_loader import load

        path = self.directory / sharded_name(step)
        load(sharded, checkpoint_id=path)
        replicated = deserialize((path / REPLICATED).read_bytes(), source=str(path / REPLICATED))
        self.saved_step = step
        return replicated
