"""What a step dropped in the middle leaves behind (``TrainingState.clear_gradients``).

A kill can break the group inside the optimizer's step, where the switch vote is
counted: after the script's ``scaler.unscale_(optim)`` and before ``scaler.update()``.
The Run drops that step and the script trains it again, calling ``unscale_`` again,
which a ``GradScaler`` refuses until its ``update()``. Seen in the realistic script's
goodput run (bench/README.md): the worker died on the retry, and the job lost 30 s to a
restart from its checkpoint instead of 1 s.
"""

from __future__ import annotations

import torch

from elasticjob_runtime.training.state import TrainingState


def test_a_dropped_steps_gradients_and_its_scalers_unscale_are_forgotten() -> None:
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    state = TrainingState()
    state.module, state.optimizer, state.registered = model, optim, {"scaler": scaler}
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optim)  # then the group broke in optim.step's pre-hook

    state.clear_gradients()

    assert all(p.grad is None for p in model.parameters())
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()  # the step, trained again
    scaler.unscale_(optim)
    scaler.step(optim)
    scaler.update()
