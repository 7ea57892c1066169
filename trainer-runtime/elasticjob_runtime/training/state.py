"""Everything a worker trains, held in one place: what is saved, sent and compared.

The Run's own objects (model, optimizer, sampler, its step counters and ``meta``) and the
user's registered Stateful objects (schedulers, scalers, EMA models) live here, so that a
checkpoint, a joiner's copy from a peer and the ranks' agreement check all see the same
set. :meth:`TrainingState.share_newest` is the rule that leaves every rank at the newest
step any rank holds in memory (or at the newest checkpoint when none does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from elasticjob_runtime.checkpoints.format import CheckpointError, state_to_save
from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.checkpoints.restore import source_rank
from elasticjob_runtime.checkpoints.state_broadcast import broadcast_state
from elasticjob_runtime.training.sampler import ElasticSampler

# The Run's own entries in the state; what users register goes beside them.
RESERVED_STATE = ("model", "optim", "sampler", "run")


def registered_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The user's state objects, checked: each a torch Stateful, under a name of its own."""
    out: dict[str, Any] = {}
    for name, obj in state.items():
        if not isinstance(name, str) or not name or name in RESERVED_STATE:
            raise ValueError(
                f"state name {name!r} is not allowed: use a non-empty string other than "
                f"{', '.join(RESERVED_STATE)} (the Run's own entries)"
            )
        methods = (getattr(obj, "state_dict", None), getattr(obj, "load_state_dict", None))
        if not all(callable(method) for method in methods):
            raise TypeError(
                f"state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(); wrap it in a class that has both (torch's Stateful "
                "protocol), or keep plain values in run.meta"
            )
        out[name] = obj
    return out


def sampler_position(sampler: ElasticSampler) -> dict[str, Any]:
    """The sampler's state as compared: a finished epoch is the next one's start (a rank
    that already moved on and one that has not hold the same position)."""
    state = dict(sampler.state_dict())
    if state["consumed"] >= state["num_samples"]:
        state.update(epoch=int(state["epoch"]) + 1, consumed=0)
    return state


class TrainingState:
    """One worker's training state and its step counters."""

    def __init__(self) -> None:
        self.step = 0  # optimizer steps completed by the whole group
        self.samples = 0  # samples those steps consumed, all ranks together
        self.meta: dict[str, Any] = {}  # saved and restored with the state (JSON-like values)
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sampler: ElasticSampler | None = None
        self.registered: dict[str, Any] = {}  # the user's Stateful objects, by name
        self.live = False  # holds state newer than any checkpoint, after the first sync

    def objects(self) -> Mapping[str, Any]:
        """What a checkpoint holds and a joiner receives."""
        return {
            "model": self.module,
            "optim": self.optimizer,
            "sampler": self.sampler,
            "run": {"step": self.step, "samples": self.samples, "meta": dict(self.meta)},
            **self.registered,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        missing = [key for key in self.objects() if key not in state]
        if missing:
            raise CheckpointError(
                f"the state to resume from has no {missing} (it has {sorted(state)}): "
                "every rank must pass the same objects to run.wrap(..., state=...), and a "
                "checkpoint saved before an object was added cannot restore it; start "
                "from a new checkpoint directory, or drop the object from state="
            )
        for key, target in self.objects().items():
            loader = getattr(target, "load_state_dict", None)
            if callable(loader):
                loader(state[key])
        self.step = int(state["run"]["step"])
        self.samples = int(state["run"].get("samples", 0))
        self.meta.clear()
        self.meta.update(state["run"]["meta"])

    def checked(self) -> dict[str, Any]:
        """What every rank must hold identically, by the name a mismatch reports.
        Not ``meta``: a script may keep rank 0's own values there (the best accuracy
        its validation saw); it is saved from one rank and handed to joiners as is."""
        assert self.sampler is not None
        return {
            "model": self.module,
            "optim": self.optimizer,
            "sampler": sampler_position(self.sampler),
            "run": {"step": self.step, "samples": self.samples},
            **self.registered,
        }

    @property
    def held_step(self) -> int:
        """The step this rank holds in memory, -1 before it first held the group's."""
        return self.step if self.live else -1

    def share_newest(
        self, rank: int, steps: Sequence[int], device: torch.device, ckpt: CheckpointManager
    ) -> str:
        """Every rank ends at the newest step any rank holds in memory; when none holds
        one (a first start, or every process restarted), at the newest checkpoint.
        ``steps``: every rank's :attr:`held_step`, gathered. Returns where this rank's
        state came from, for ``Run.resumed_from``."""
        resumed_from = self._take_newest(rank, steps, device, ckpt)
        self.live = True  # only once it holds the group's state: a failed share retries
        return resumed_from

    def _take_newest(
        self, rank: int, steps: Sequence[int], device: torch.device, ckpt: CheckpointManager
    ) -> str:
        world_size = len(steps)
        newest = max(steps)
        if newest < 0:
            resumed = ckpt.restore(self.objects())  # agrees over the group itself
            if resumed is not None:
                self.load(resumed.state)
                return f"checkpoint step {resumed.step}"
            if world_size > 1:
                # A fresh start: rank 0's state is the run's (DDP copies only the module's
                # parameters; an EMA or a scheduler built from an unseeded model would differ).
                self.copy_from(0, rank, device)
            return "fresh"
        src = source_rank(steps)  # the same rule as a checkpoint's restore over the group
        if src is not None:
            behind = [r for r, step in enumerate(steps) if step != newest]
            self.copy_from(src, rank, device, receivers=behind)
        if steps[rank] == newest:
            return f"own memory at step {newest}"
        return f"rank {src} at step {newest}"

    def copy_from(
        self,
        src: int,
        rank: int,
        device: torch.device,
        *,
        receivers: Sequence[int] | None = None,
    ) -> None:
        """``receivers`` (default: every rank but ``src``) take rank ``src``'s whole
        state; the other ranks hold it already and take no part."""
        sent = state_to_save(self.objects()) if rank == src else None
        received = broadcast_state(sent, src, device, receivers=receivers)
        if received is not None:
            self.load(received)

    def clear_gradients(self) -> None:
        """A dropped step's gradients are partial (some buckets reduced, some not) and
        would be added into the retried step by a script that zeroes after stepping;
        a registered ``GradScaler`` forgets the step's ``unscale_`` (the retry calls it
        again, which torch refuses before an ``update()``)."""
        if self.module is not None:
            self.module.zero_grad(set_to_none=True)
        for optimizer in (self.optimizer, *self.registered.values()):
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.zero_grad(set_to_none=True)
        for scaler in self.registered.values():
            if isinstance(scaler, torch.amp.GradScaler):
                from elasticjob_runtime.launch.torch_internals import forget_unscale

                forget_unscale(scaler)
