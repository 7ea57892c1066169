"""Each rank's gradient weighed by its share of the global batch, in DDP's all-reduce.

DDP averages the ranks' gradients: right when every rank trains on as many samples, off
at an epoch's uneven end, and wrong for a rank with no sample at all (which must still
take part in the all-reduce). With :meth:`elasticjob_runtime.training.run.Run.loader` each
rank's gradient is multiplied by ``samples on this rank / global batch`` before the sum:
DDP's average when the shares are equal; when they are not, the mean over the global
batch for a rank loss that is the mean over its own samples; zero for the filler batch
of a rank that has no sample left.

No ``from __future__ import annotations`` here: DDP checks a hook's annotations at
``register_comm_hook`` and refuses them as strings.
"""

from typing import Protocol

import torch
import torch.distributed as dist


class Shares(Protocol):
    """What the hook reads of the Run at each all-reduce."""

    @property
    def world_size(self) -> int: ...

    @property
    def global_batch(self) -> int: ...

    @property
    def weighted_samples(self) -> int | None:
        """This rank's samples in the step; None: weigh as DDP does."""


# dist.GradBucket is public (torch's own hooks take it) but missing from torch's stubs.
def weighted_allreduce(
    shares: Shares,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook (``ddp.register_comm_hook(run, weighted_allreduce)``)."""
    buffer = bucket.buffer()
    samples = shares.weighted_samples
    if samples is None or shares.global_batch <= 0:
        buffer.div_(shares.world_size)
    elif samples == 0:
        buffer.zero_()  # not a multiplication: a filler's inf or NaN times 0 is NaN
    else:
        buffer.mul_(samples / shares.global_batch)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return reduced
