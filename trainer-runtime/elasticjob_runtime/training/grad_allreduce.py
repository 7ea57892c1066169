"""The step's gradient all-reduce: DDP's communication hook, on every DDP the Run wraps.

It does two things DDP's own all-reduce does not.

**It carries the switch vote** (:mod:`elasticjob_runtime.training.switch_vote`). The
ballot a rank cast as the step began rides as one more element on the first small dense
bucket the step reduces, so the ranks agree whether the round ends after this step at the
price of one number in a collective that runs anyway, not of a collective of its own.

**It weighs each rank's gradient by its share of the global batch** once
:meth:`elasticjob_runtime.training.run.Run.loader` is in use. DDP averages the ranks'
gradients: right when every rank trains on as many samples, off at an epoch's uneven
end, and wrong for a rank with no sample at all (which must still take part in the
all-reduce). So each rank's gradient is multiplied by ``samples on this rank / global
batch`` before the sum: DDP's average when the shares are equal; when they are not, the
mean over the global batch for a rank loss that is the mean over its own samples; zero
for the filler batch of a rank that has no sample left. Without the loader it averages
as DDP does.

The Run owns the DDP's one communication hook; a script cannot register another.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations at
``register_comm_hook`` and refuses them as strings.
"""

from typing import Protocol

import torch
import torch.distributed as dist

from elasticjob_runtime.training.switch_vote import SwitchVote


class Shares(Protocol):
    """What the hook reads of the Run at each all-reduce to weigh the gradients."""

    @property
    def world_size(self) -> int: ...

    @property
    def global_batch(self) -> int: ...

    @property
    def weighted_samples(self) -> int | None:
        """This rank's samples in the step; None: weigh as DDP does."""


class StepAllreduce:
    """The hook's state: the vote it carries, and the shares it weighs by (None: DDP's
    average, until the loader is in use)."""

    def __init__(self, vote: SwitchVote) -> None:
        self.vote = vote
        self.shares: Shares | None = None


def batch_share(shares: Shares | None) -> float | None:
    """This rank's share of the step's global batch; None: an equal share (the loader is
    not in use, or the step's shares are unknown). Sharded models weigh by it too
    (fsdp_reduce_scatter.py)."""
    if shares is None:
        return None
    samples = shares.weighted_samples
    if samples is None or shares.global_batch <= 0:
        return None
    return samples / shares.global_batch


def weigh(buffer: torch.Tensor, state: StepAllreduce) -> None:
    """Scale this rank's gradients in place before the sum."""
    share = batch_share(state.shares)
    if share is None:
        world = state.shares.world_size if state.shares is not None else dist.get_world_size()
        buffer.div_(world)
    elif share == 0:
        buffer.zero_()  # not a multiplication: a filler's inf or NaN times 0 is NaN
    else:
        buffer.mul_(share)


# dist.GradBucket is public (torch's own hooks take it) but missing from torch's stubs.
def step_allreduce(
    state: StepAllreduce,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook (``ddp.register_comm_hook(state, step_allreduce)``)."""
    buffer: torch.Tensor = bucket.buffer()
    weigh(buffer, state)
    payload = state.vote.carry(buffer)
    work = dist.all_reduce(payload, async_op=True)
    assert work is not None
    if payload is buffer:
        reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(
            lambda fut: fut.value()[0]
        )
        return reduced

    def unpack(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.wait()
        buffer.copy_(payload[:-1])
        return buffer

    unpacked: torch.futures.Future[torch.Tensor] = work.get_future().then(unpack)
    return unpacked
