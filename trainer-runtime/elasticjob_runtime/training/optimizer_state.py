"""A sharded optimizer's state on a new round's mesh, made without stepping the optimizer.

Moving optimizer state in place (fsdp_replication.py) needs a target: the new round's
optimizer with state tensors of the new shards' shape, which the moved rows fill. torch
makes one by stepping the optimizer once with zero gradients and no learning rate
(``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` both do when it has no
state). On a new mesh that step is the slowest part of a join's regroup: every op pays
DTensor's sharding decisions afresh, and a joiner pays its process's first optimizer
step too (0.5-0.9 s of a 1.5 s regroup at three ranks on two cores).

Where every sharded entry of the old state is shaped and placed as its parameter (Adam,
AdamW, SGD with momentum: ``zeros_like(param)``), :func:`sharded_layout` says which keys
those are, and :func:`make_state` gives the new optimizer empty tensors of them wrapped
as the new parameters' DTensors, plus the scalar entries (Adam's ``step``), without any
op on the mesh. Any other state (an entry shaped or placed otherwise) gets torch's step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from elasticjob_runtime.checkpoints.dcp_parts import laid_out_as

# fqn -> state key -> the dtype name of a sharded entry (``float32``), "" for any other
# (Adam's ``step``), in the state's own order, which a fingerprint of it follows
Layout = dict[str, dict[str, str]]


def sharded_layout(optim: torch.optim.Optimizer, osd: Mapping[str, Any]) -> Layout | None:
    """The sharded entries of ``osd`` (``get_optimizer_state_dict(model, optim)``) by
    parameter name, or None when one is not shaped and placed as its parameter."""
    from torch.distributed.tensor import DTensor

    if not osd["state"]:
        return {}  # it never stepped: nothing to make
    params = [p for group in optim.param_groups for p in group["params"]]
    names = [fqn for group in osd["param_groups"] for fqn in group["params"]]
    if len(params) != len(names):
        return None
    by_name = dict(zip(names, params, strict=True))
    layout: Layout = {}
    for fqn, entries in osd["state"].items():
        param = by_name.get(fqn)
        for key, value in entries.items():
            if not isinstance(value, DTensor):
                layout.setdefault(fqn, {})[key] = ""
                continue
            if not (
                isinstance(param, DTensor)
                and value.shape == param.shape
                and value.placements == param.placements
                and value.device_mesh == param.device_mesh
            ):
                return None
            layout.setdefault(fqn, {})[key] = str(value.dtype).removeprefix("torch.")
    return layout


def make_state(
    optim: torch.optim.Optimizer,
    saved_groups: Sequence[Mapping[str, Any]],
    layout: Layout,
    scalars: Mapping[str, Mapping[str, Any]],
) -> bool:
    """Give ``optim`` (a new round's, without state) the state ``layout`` describes:
    its sharded entries empty, to be filled, the others from ``scalars`` (fqn -> key ->
    value). ``saved_groups`` are the old optimizer's param groups, whose ``params`` name
    each parameter in order. False (nothing made) when they do not match this
    optimizer's groups."""
    from torch.distributed.tensor import DTensor

    groups = optim.param_groups
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)
    ):
        return False
    for group, saved in zip(groups, saved_groups, strict=True):
        for param, fqn in zip(group["params"], saved["params"], strict=True):
            keys, values = layout.get(fqn, {}), scalars.get(fqn, {})
            if not keys:
                continue
            if any(keys.values()) and not isinstance(param, DTensor):
                optim.state.clear()
                return False
            state: dict[str, Any] = {}
            for key, dtype in keys.items():
                if not dtype:
                    value = values[key]
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
                    continue
                local = torch.empty_like(param.to_local(), dtype=getattr(torch, dtype))
                state[key] = laid_out_as(param, local)
            optim.state[param] = state
    return True
