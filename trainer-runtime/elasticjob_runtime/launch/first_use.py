"""A training step's first-use costs, paid by a warm spare before any worker needs it.

A process pays extra the first time it runs a forward, a backward, an optimizer's
step, a ``state_dict`` round trip and a ``torch.load`` (lazy imports, Python paths
taken once, the safe unpickler's allowed globals): 6-15 ms here beside a second pass,
twice that on two busy cores. A worker that joins a running group, or replaces a killed
one, pays it on the group's time: its peers wait for its first step (and for its load
of the state they send), and the regression example's join paused about 0.1 s in all.
So the spare (the template, once, before it forks) runs a tiny model through all of
it while it waits idle. Only torch's generic paths warm up: kernels chosen by a
model's own shapes, and its heap (docs/recovery.md), are the worker's.

Nothing it does shows: the random number generator's state is put back, no gradient
mode or thread count changes, no process group is made, nothing is printed.
"""

from __future__ import annotations

import io
import warnings

import torch
from torch import nn


def exercise() -> None:
    """Run a tiny model through one training step and a state round trip, on the CPU."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.enable_grad():
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 2))
            optimizers = [
                torch.optim.Adam(model.parameters()),
                torch.optim.AdamW(model.parameters()),
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            ]
            batch = torch.ones(2, 4)
            loss = nn.functional.cross_entropy(model(batch), torch.tensor([0, 1]))
            loss.backward()  # type: ignore[no-untyped-call]
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        state = {"model": model.state_dict(), "optim": optimizers[0].state_dict()}
        saved = io.BytesIO()
        torch.save(state, saved)
        loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizers[0].load_state_dict(loaded["optim"])
