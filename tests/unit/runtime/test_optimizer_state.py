"""An optimizer's state on a new mesh made without a step (training/optimizer_state.py),
against the state torch makes by stepping it, on a real FSDP2 model over a 1-rank gloo
group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elasticjob_runtime.training.optimizer_state import make_state, sharded_layout


@pytest.fixture
def group() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(generation: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(f"shard{generation}",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trained(make: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = sharded(0)
    optim = make(model.parameters())
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def osd_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optim))


def described(osd: dict[str, Any]) -> dict[str, list[tuple[str, Any, Any, Any]]]:
    """Each entry's key, shape, dtype and placements, in the state's order."""
    return {
        fqn: [
            (k, tuple(v.shape), v.dtype, getattr(v, "placements", None))
            for k, v in entries.items()
            if isinstance(v, torch.Tensor)
        ]
        for fqn, entries in osd["state"].items()
    }


def trained_adamw() -> tuple[dict[str, Any], Any]:
    """A trained AdamW's state dict, and its layout (which there is: Adam's entries are
    shaped and placed as their parameters)."""
    model, optim = trained(lambda p: torch.optim.AdamW(p, lr=0.1))
    old = osd_of(model, optim)
    layout = sharded_layout(optim, old)
    assert layout is not None
    return old, layout


@pytest.mark.usefixtures("group")
def test_adamw_state_on_a_new_mesh_is_torchs_without_a_step() -> None:
    old, layout = trained_adamw()
    scalars = {
        fqn: {k: v for k, v in e.items() if not hasattr(v, "placements")}
        for fqn, e in old["state"].items()
    }

    by_torch = sharded(1)  # the state torch makes: a step with zero gradients
    torch_optim = torch.optim.AdamW(by_torch.parameters(), lr=0.1)
    wanted = described(osd_of(by_torch, torch_optim))

    model = sharded(1)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    assert make_state(optim, old["param_groups"], layout, scalars)
    got = osd_of(model, optim)  # torch steps an optimizer only when it has no state
    assert described(got) == wanted
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for fqn, entries in got["state"].items():
        assert torch.equal(entries["step"], old["state"][fqn]["step"])


class RowSums(torch.optim.Optimizer):
    """Keeps a sum per row of each matrix's gradients: state not shaped like its
    parameter (as factored optimizers keep)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                rows = p.grad.sum(dim=-1) if p.grad.dim() > 1 else p.grad.clone()
                state = self.state[p]
                state["rows"] = state["rows"] + rows if "rows" in state else rows


@pytest.mark.usefixtures("group")
def test_state_shaped_otherwise_than_its_parameter_is_left_to_torchs_step() -> None:
    model, optim = trained(RowSums)
    assert sharded_layout(optim, osd_of(model, optim)) is None


@pytest.mark.usefixtures("group")
def test_an_optimizer_with_other_groups_gets_nothing() -> None:
    old, layout = trained_adamw()
    model = sharded(1)
    params = list(model.parameters())
    optim = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    assert not make_state(optim, old["param_groups"], layout, {})
    assert not optim.state
