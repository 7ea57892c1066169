"""The model as the current round's ``DistributedDataParallel`` wraps it.

DDP binds a module to one process group, so every regroup wraps the module anew.
:class:`CurrentDDP` is what ``run.wrap()`` returns: call it and read its attributes as
the DDP module of the round in force. The Run restores the state before each wrap and
compares it after, so DDP's own broadcast of every parameter (``init_sync``) is skipped.

A DDP forward makes no collective, so a step whose group was given up (a peer died)
would compute on until its gradients' all-reduce fails: with gradient accumulation,
every micro-batch left. Each call first asks the Run (``before_forward``), which drops
such a step there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elasticjob_runtime.training.grad_allreduce import Shares, StepAllreduce, step_allreduce
from elasticjob_runtime.training.switch_vote import SwitchVote


class CurrentDDP:
    """One module, wrapped once per round, its gradients summed by the Run's hook."""

    def __init__(
        self,
        module: nn.Module,
        ddp_kwargs: dict[str, Any],
        vote: SwitchVote,
        before_forward: Callable[[], None] = lambda: None,
    ) -> None:
        """``before_forward()`` runs before each call and may raise: the Run's drops a
        step whose group was given up (StepLoop.forward_allowed)."""
        self._module = module
        self._before_forward = before_forward
        self._kwargs = {"init_sync": False, **ddp_kwargs}
        self._ddp: DistributedDataParallel | None = None
        self._hook = StepAllreduce(vote)

    @property
    def ddp(self) -> DistributedDataParallel:
        if self._ddp is None:
            raise RuntimeError("call run.wrap(model, optimizer, sampler) first")
        return self._ddp

    def rewrap(self) -> None:
        """Wrap the module for the round just formed (its group is the default one)."""
        self._ddp = DistributedDataParallel(self._module, **self._kwargs)
        self._ddp.register_comm_hook(self._hook, step_allreduce)

    def weigh_by_samples(self, shares: Shares) -> None:
        """From now on, each rank's gradient counts by its share of the global batch."""
        self._hook.shares = shares

    def retire(self) -> DistributedDataParallel | None:
        """Take the round's DDP out of use; the caller frees it once the next round stands
        (freeing it joins gloo's threads, which may still be finishing aborted work)."""
        ddp, self._ddp = self._ddp, None
        return ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        return self.ddp(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ddp, name)
