"""How the ranks of a round hold the model: the seam between the Run and DDP or FSDP2.

The Run's regroup is the same whatever the model's layout (leave the round, wait for the
next, build its process group, bring every rank to the newest step, check); what differs
is what "the model" is on a rank, how it is wrapped for a round, how the newest state
reaches every rank, which state the ranks must hold identically, and how it is saved.
Those are a :class:`Replication`; there is one module per kind, as torch keeps each
rendezvous backend behind ``rendezvous/api.py``:

* :mod:`elasticjob_runtime.training.ddp_replication`: the whole model on every rank,
  DDP each round; state reaches a rank as one peer's whole copy; one file per checkpoint.
* :mod:`elasticjob_runtime.training.fsdp_replication`: FSDP2 or HSDP shards, the model
  rebuilt on each round's mesh (mesh_shape.py); shards move between ranks' memory
  (reshard.py); DCP checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

from elasticjob_runtime.training.grad_allreduce import Shares
from elasticjob_runtime.training.worker_rounds import WorkerRounds


class Replication(Protocol):
    """One layout of the model over a round's ranks."""

    # True when a checkpoint is every rank's together (each its own shards): then the
    # ranks agree on the step they stop at after a SIGTERM, and save it together;
    # False when each rank's own save after a SIGTERM holds the whole state (DDP).
    saves_together: bool

    def holding(self) -> list[int]:
        """What this rank holds of the model, as integers, as many on every rank: the
        Run gathers it with the rest of the formation's row (formation.py) and hands
        every rank's to :meth:`form`."""
        ...

    def form(
        self, rounds: WorkerRounds, timings: dict[str, float], holdings: Sequence[Sequence[int]]
    ) -> str:
        """Wrap the model for the round just formed and leave every rank at the newest
        step any rank holds (or the newest checkpoint); every member calls it, with every
        rank's :meth:`holding` in rank order. Returns where this rank's state came from
        (``Run.resumed_from``); writes the seconds of its phases into ``timings``."""
        ...

    def retire(self) -> object | None:
        """Take the round's wrapper out of use and keep what the next round needs from
        it; the caller frees what this returns once the next round stands (freeing it
        joins gloo's threads, which may still be finishing aborted work)."""
        ...

    def checked(self) -> dict[str, Any]:
        """What every rank must hold identically, by name (agreement.py compares it)."""
        ...

    def checked_within_replicas(self) -> tuple[int, dict[str, Any]]:
        """What the ranks that hold the same shard must hold identically (HSDP's
        replicas of one shard), by name, with the index of this rank's shard: compared
        among the ranks of each index, never across. Empty where no two ranks hold the
        same shard; the same names on every rank."""
        ...

    def resync(self, rounds: WorkerRounds) -> None:
        """Every rank takes rank 0's copy of what :meth:`checked` covers
        (``on_divergence="resync"``); every member calls it."""
        ...

    def weigh_by_samples(self, shares: Shares) -> None:
        """From now on each rank's gradient counts by its share of the global batch."""
        ...

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """A micro-batch whose gradient is kept on this rank, not yet reduced."""
        ...

    @property
    def saved_step(self) -> int | None:
        """The newest step saved (or restored), for the progress record."""
        ...

    def save(self, step: int) -> None:
        """Checkpoint ``step`` unless it is saved or being saved; every rank calls it."""
        ...

    def flush_saves(self) -> None:
        """Finish the checkpoint in flight before the worker exits; every rank calls it."""
        ...

    def committed(self, step: int, rounds: WorkerRounds, switching: bool) -> None:
        """After ``step`` committed, on every rank: keep what a lost rank's peers would
        need (FSDP2's shard copies; ``switching``: the ranks agreed to leave the round
        after this step, some perhaps for good); a collective that fails here means the
        group broke."""
        ...
