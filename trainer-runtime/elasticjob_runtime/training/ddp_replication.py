"""The whole model on every rank: DDP each round, state handed over whole.

Every rank holds the same model, optimizer and registered state, so the newest step
reaches a rank as one peer's whole copy (TrainingState.share_newest: a joiner, a rank
one step behind), the ranks compare fingerprints of all of it, and rank 0 writes one
checkpoint file (:class:`~elasticjob_runtime.checkpoints.manager.CheckpointManager`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.training.current_ddp import CurrentDDP
from elasticjob_runtime.training.grad_allreduce import Shares
from elasticjob_runtime.training.state import TrainingState
from elasticjob_runtime.training.worker_rounds import WorkerRounds


class DDPReplication:
    """:class:`~elasticjob_runtime.training.replication.Replication` for DDP."""

    saves_together = False  # every rank holds the whole state: each saves it on SIGTERM

    def __init__(self, state: TrainingState, ckpt: CheckpointManager, model: CurrentDDP) -> None:
        self._state, self._ckpt, self.model = state, ckpt, model

    def holding(self) -> list[int]:
        """The step this rank holds in memory, -1 for none."""
        return [self._state.held_step]

    def form(
        self, rounds: WorkerRounds, timings: dict[str, float], holdings: Sequence[Sequence[int]]
    ) -> str:
        started = time.monotonic()
        steps = [held[0] for held in holdings]
        resumed = self._state.share_newest(rounds.rank, steps, rounds.device, self._ckpt)
        wrapped = time.monotonic()
        self.model.rewrap()
        timings["restore"] = wrapped - started
        timings["ddp"] = time.monotonic() - wrapped
        return resumed

    def retire(self) -> object | None:
        return self.model.retire()

    def checked(self) -> dict[str, Any]:
        return self._state.checked()

    def checked_within_replicas(self) -> tuple[int, dict[str, Any]]:
        """Nothing more: :meth:`checked` covers the whole state, held alike by all."""
        return 0, {}

    def resync(self, rounds: WorkerRounds) -> None:
        self._state.copy_from(0, rounds.rank, rounds.device)

    def weigh_by_samples(self, shares: Shares) -> None:
        self.model.weigh_by_samples(shares)

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        return self.model.ddp.no_sync()

    @property
    def saved_step(self) -> int | None:
        return self._ckpt.saved_step

    def save(self, step: int) -> None:
        if step not in (self._ckpt.saved_step, self._ckpt.pending_step):
            self._ckpt.save(self._state.objects(), step)

    def flush_saves(self) -> None:
        """Nothing: the Run's CheckpointManager finishes its own save (Run.finish)."""

    def committed(self, step: int, rounds: WorkerRounds, switching: bool) -> None:
        """Nothing: every rank holds the whole state, and a peer's copy is one away."""
