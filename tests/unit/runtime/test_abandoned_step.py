"""A step whose group was given up is dropped at its next forward (current_ddp.py): a DDP
forward makes no collective, so without the check a survivor computed every micro-batch
left in the step before its gradients' all-reduce failed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticjob_runtime.training.current_ddp import CurrentDDP
from elasticjob_runtime.training.switch_vote import SwitchVote
from elasticjob_runtime.training.worker_rounds import GroupAbandoned, collective_failed


def test_the_forward_asks_first_and_what_it_raises_drops_the_step() -> None:
    asked: list[str] = []

    def given_up() -> None:
        asked.append("forward")
        raise GroupAbandoned("round 3's group was given up")

    model = CurrentDDP(nn.Linear(2, 2), {}, SwitchVote(), given_up)
    with pytest.raises(GroupAbandoned) as raised:
        model(torch.ones(1, 2))  # no round wrapped yet: the question comes before DDP
    assert asked == ["forward"]
    # the step loop drops a step (and regroups) on what collective_failed accepts
    assert collective_failed(raised.value)


def test_a_forward_that_may_go_on_reaches_the_round_s_ddp() -> None:
    model = CurrentDDP(nn.Linear(2, 2), {}, SwitchVote())
    with pytest.raises(RuntimeError, match=r"call run\.wrap"):
        model(torch.ones(1, 2))
