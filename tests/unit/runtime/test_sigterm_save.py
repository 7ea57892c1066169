"""A SIGTERM save off the step boundary: the rule that decides it, and the guard that
keeps an optimizer update from changing the state under it."""

from __future__ import annotations

import threading

import pytest
import torch

from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.checkpoints.sigterm_save import (
    Action,
    SigtermSave,
    UpdateGuard,
    off_boundary_action,
)


@pytest.mark.parametrize(
    ("update_in_step", "wait_s", "action"),
    [
        (False, 0.0, Action.SAVE_NOW),  # the state is the last completed step's
        (False, 5.0, Action.SAVE_NOW),  # no reason to wait
        (True, 5.0, Action.WAIT_FOR_BOUNDARY),  # past it: only the boundary saves it
        (True, 0.0, Action.LEAVE),  # and no time left for the boundary: no save
    ],
)
def test_off_boundary_rule(update_in_step: bool, wait_s: float, action: Action) -> None:
    assert off_boundary_action(update_in_step, wait_s) is action


def test_an_update_since_the_boundary_keeps_the_save_off_until_the_next_boundary() -> None:
    guard = UpdateGuard()
    guard.before_update()
    assert guard.claim(2.0) is Action.WAIT_FOR_BOUNDARY
    assert guard.claim(0.0) is Action.LEAVE
    guard.boundary()
    assert guard.claim(0.0) is Action.SAVE_NOW


def test_a_save_of_the_last_step_holds_off_every_later_update() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    optim = torch.optim.SGD(params, lr=0.5)
    ckpt = CheckpointManager("/nonexistent", memory=False)
    ckpt.guard_updates(optim)
    params[0].grad = torch.ones(3)
    assert ckpt._sigterm.guard.claim(2.0) is Action.SAVE_NOW

    stepping = threading.Thread(target=optim.step, daemon=True)  # blocks for good
    stepping.start()
    stepping.join(0.3)
    assert stepping.is_alive()
    assert torch.equal(params[0].detach(), torch.ones(3))  # the saved step's, still


def test_a_guarded_optimizers_update_is_seen_and_the_boundary_forgets_it() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    optim = torch.optim.SGD(params, lr=0.5)
    ckpt = CheckpointManager("/nonexistent", memory=False)
    ckpt.guard_updates(optim)
    params[0].grad = torch.ones(3)
    optim.step()
    assert ckpt._sigterm.guard.claim(0.0) is Action.LEAVE
    ckpt.mark_step(1)
    assert ckpt._sigterm.guard.claim(0.0) is Action.SAVE_NOW


@pytest.mark.parametrize(("updated", "saves"), [(False, 1), (True, 0)])
def test_at_exit_after_sigterm_saves_only_a_state_no_update_changed(
    updated: bool, saves: int
) -> None:
    saved: list[int] = []
    sigterm = SigtermSave(lambda: saved.append(7), lambda: 7)
    sigterm._requested.set()  # what the handler does first
    if updated:
        sigterm.guard.before_update()
    sigterm._at_exit()
    assert len(saved) == saves
