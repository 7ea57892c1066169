"""Checkpoints of sharded state: torch.distributed.checkpoint (DCP) files, written in the
background by every rank for its own shards, committed by a rename.

No rank ever holds the whole model; DCP's metadata records the global layout, so a
checkpoint restores at any world size (``dcp.load`` reads each rank's new rows). A save
has three parts, so that training waits only for the first:

1. **plan**, on the training thread: rank 0 draws the save's token (a broadcast), each
   rank copies its shards to CPU (reusing the last save's buffers), and DCP's planner
   gathers the ranks' plans on rank 0 and sends each its part (a gather and a scatter,
   all on the round's group).
2. **write**, in a thread on every rank, with no collective (a regroup cannot strand
   it): this rank's shards into ``sharded-<step>.<token>.partial/`` (a directory of this
   save's own), then a ``written-<rank>`` file holding DCP's record of what it wrote.
3. **commit**, in rank 0's thread, once every rank's ``written-`` file is there: DCP's
   metadata, the replicated state (sampler, counters, schedulers: one ``torch.save``
   file, loaded as data only), and the rename to ``sharded-<step>/``. A directory with
   that name is a complete checkpoint, one still ``.partial`` a save that did not finish.
   The last ``keep`` stay.

Rank 0 stops waiting for the parts at the next save, load or close: every live rank has
finished its own part before it reaches that save's collectives, so a part still
missing then is a dead rank's, and that save stays ``.partial`` (removed at the next
commit). With ``background`` off, a save waits for all three parts (every rank, then a
barrier).

The directory must be one every rank reaches (the manifest's shared volume). The
``written-`` files are pickles, as DCP's own ``.metadata`` is.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elasticjob_runtime.checkpoints.files import write_atomic
from elasticjob_runtime.checkpoints.format import deserialize

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    from elasticjob_runtime.checkpoints.dcp_parts import SaveParts

log = logging.getLogger(__name__)

_NAME = re.compile(r"^sharded-(\d{10})$")
PARTIAL = ".partial"
_PARTIAL_NAME = re.compile(r"^sharded-(\d{10})\.[0-9a-f]+\.partial$")
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


WRITTEN_PREFIX = "written-"
POLL_S = 0.05  # rank 0 looking for the other ranks' written- files


@dataclass
class _Save:
    """One save in flight on this rank (module docstring, parts 2 and 3)."""

    step: int
    partial: Path
    written: threading.Event = field(default_factory=threading.Event)  # this rank's part
    stop: threading.Event = field(default_factory=threading.Event)  # rank 0: stop waiting
    thread: threading.Thread | None = None
    error: BaseException | None = None


class ShardedCheckpoints:
    """Save and restore a sharded state dict with DCP (see the module docstring)."""

    def __init__(self, directory: Path, keep: int, background: bool = True) -> None:
        self.directory = directory
        self.keep = keep
        self.background = background
        self.saved_step: int | None = None  # written by this rank (or restored)
        self._pending: _Save | None = None
        self._staged: dict[str, Any] | None = None  # the last save's CPU copy, reused

    @property
    def pending_step(self) -> int | None:
        """The step of the save whose part this rank may still be writing."""
        pending = self._pending
        return pending.step if pending is not None and not pending.written.is_set() else None

    def save(self, step: int, sharded: dict[str, Any], replicated: bytes) -> None:
        """Every rank calls it with its own ``sharded`` state dict (DTensors) and the same
        ``replicated`` bytes; returns once the state is copied and planned."""
        from elasticjob_runtime.checkpoints.dcp_parts import SaveParts, stage

        rank, world = dist.get_rank(), dist.get_world_size()
        coordinator = rank == 0
        self.wait_own_part()  # a part still being written would read the buffers
        # Each save writes into a directory of its own, so an older save of the same
        # step (before a rollback) that a process still waits on cannot mix with it.
        token: list[Any] = [uuid.uuid4().hex[:8] if coordinator else None]
        dist.broadcast_object_list(token, src=0)
        partial = self.directory / f"{sharded_name(step)}.{token[0]}{PARTIAL}"
        self._staged = staged = stage(sharded, self._staged)
        parts = SaveParts(staged, partial, rank, coordinator)  # its local plan makes the directory
        plans: list[Any] | None = [None] * world if coordinator else None
        dist.gather_object(parts.local_plan(), plans, dst=0)
        mine: list[Any] = [None]
        metadata = None
        if coordinator:
            assert plans is not None
            plans, metadata = parts.global_plan(plans)
        dist.scatter_object_list(mine, plans, src=0)
        # Past the scatter, every live rank has written its part of the last save.
        self._settle()
        save = _Save(step, partial)

        def work() -> None:
            self._write_part(save, parts, mine[0], rank)
            if metadata is not None and save.error is None:  # rank 0 has the metadata
                self._commit_when_written(save, parts, metadata, world, replicated)

        save.thread = threading.Thread(target=work, name=f"sharded-checkpoint-{step}", daemon=True)
        self._pending = save
        save.thread.start()
        if not self.background:
            self.close()

    def _write_part(self, save: _Save, parts: SaveParts, plan: SavePlan, rank: int) -> None:
        try:
            results = parts.write(plan)
            write_atomic(save.partial, f"{WRITTEN_PREFIX}{rank}", pickle.dumps(results))
        except BaseException as exc:
            save.error = exc
            log.warning("sharded checkpoint step %d: this rank's part failed: %s", save.step, exc)
        else:
            self.saved_step = save.step
        finally:
            save.written.set()

    def _commit_when_written(
        self, save: _Save, parts: SaveParts, metadata: Metadata, world: int, replicated: bytes
    ) -> None:
        """Rank 0's thread: commit once every rank's part is there, or until told to stop
        (then commit only if they all are)."""
        names = [f"{WRITTEN_PREFIX}{rank}" for rank in range(world)]
        while True:
            stopping = save.stop.is_set()
            if all((save.partial / name).is_file() for name in names):
                break
            if stopping:
                log.warning(
                    "sharded checkpoint step %d abandoned: a rank's part never came (it left "
                    "the group); it stays %s",
                    save.step,
                    save.partial.name,
                )
                return
            save.stop.wait(POLL_S)
        try:
            results = [pickle.loads((save.partial / name).read_bytes()) for name in names]
            parts.finish(metadata, results)
            write_atomic(save.partial, REPLICATED, replicated)
            for name in names:
                (save.partial / name).unlink()
            final = self.directory / sharded_name(save.step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(save.partial, final)
            self._prune(save.step)
            self._remove_unfinished(save.step)
        except OSError as exc:
            save.error = exc
            log.warning("sharded checkpoint step %d not committed: %s", save.step, exc)

    def wait_own_part(self) -> None:
        """Wait until this rank's part of the save in flight is written (local disk work:
        bounded, and no collective it could be stranded in)."""
        if self._pending is not None:
            self._pending.written.wait()

    def _settle(self) -> None:
        """After a collective that every live rank reached with its part written: the
        save in flight is committed now (by this process, if it was that save's rank 0),
        or never (a dead rank's part is missing)."""
        pending, self._pending = self._pending, None
        if pending is None or pending.thread is None:
            return
        pending.stop.set()
        pending.thread.join()

    def close(self) -> None:
        """Finish the save in flight: every rank's part, then rank 0's commit, which every
        rank then sees. Every rank calls it (two barriers on the round's group), with or
        without a save in flight."""
        self.wait_own_part()
        dist.barrier()
        self._settle()
        dist.barrier()

    def _remove_unfinished(self, committed: int) -> None:
        """Saves that never finished, of steps up to ``committed`` (a newer one may be a
        save still in flight)."""
        for name in os.listdir(self.directory):
            match = _PARTIAL_NAME.match(name)
            if match and int(match.group(1)) <= committed:
                shutil.rmtree(self.directory / name, ignore_errors=True)

    def _prune(self, newest: int) -> None:
        for step in committed_sharded_steps(self.directory)[: -self.keep]:
            if step != newest:
                shutil.rmtree(self.directory / sharded_name(step), ignore_errors=True)

    def newest_step(self, device: torch.device) -> int:
        """The newest complete checkpoint's step as rank 0 sees it (-1: none), on every
        rank (they must load the same one). A save in flight is finished first: its
        commit could otherwise prune the step the ranks agree on."""
        self.close()
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
