"""FSDP2's gradient reduce-scatter as the Run does it: summed, then weighed by batch share.

Two things FSDP2's own reduce-scatter gets wrong or cannot do here:

* **gloo's average is a sum.** With gloo, FSDP2's reduce-scatter with ``ReduceOp.AVG``
  returns the summed gradients (pytorch#162338, open): gloo emulates the reduce-scatter
  as an all-reduce and a chunk. The Run turns on FSDP2's
  ``set_force_sum_reduction_for_comms(True)``: the collective sums and FSDP2 divides by
  the world size after it. tests/integration/recovery/test_fsdp_in_place.py compares a
  sharded run with one process training the same global batch, and fails if the
  averaging is ever wrong again.
* **Each rank counts by its share of the global batch** once ``run.loader`` is in use, as
  the DDP hook does (grad_allreduce.py): this rank's unsharded gradients are multiplied by
  ``share * world_size`` before the sum, so FSDP2's division leaves ``share``; a filler
  batch (no sample) counts for zero. With HSDP the shard group's sum is then summed over
  the replicas (FSDP2's all-reduce), and FSDP2 divides by the whole world all the same.

It is FSDP2's public ``FSDPModule.set_custom_reduce_scatter`` hook; torch's comm
interface is duck-typed here (``allocate`` and the call), its base class being private.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from elasticjob_runtime.training.grad_allreduce import Shares, batch_share


class WeighedReduceScatter:
    """The comm FSDP2 calls for each group of parameters' reduce-scatter."""

    def __init__(self) -> None:
        self.shares: Shares | None = None

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(
                f"FSDP2 asked for a {op} reduce-scatter; the Run sums and lets FSDP2 divide "
                "(set_force_sum_reduction_for_comms): do not turn that off"
            )
        share = batch_share(self.shares)
        if share == 0:
            input_tensor.zero_()  # a filler batch: not a multiplication (its NaN times 0 is NaN)
        elif share is not None:  # FSDP2 divides by every data-parallel rank (HSDP's too)
            input_tensor.mul_(share * dist.get_world_size())
        work: dist.Work | None = dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
        return work


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every module ``fully_shard`` was applied to, the root among them."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def install(model: nn.Module, comm: WeighedReduceScatter) -> None:
    """Make every FSDP2 module of ``model`` sum its gradients through ``comm``."""
    from torch.distributed.fsdp import FSDPModule

    for module in fsdp_modules(model):
        assert isinstance(module, FSDPModule)
        module.set_force_sum_reduction_for_comms(True)
        module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
