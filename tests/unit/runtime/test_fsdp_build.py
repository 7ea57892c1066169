"""What ``build(mesh)`` must return to ``run.shard`` (training/fsdp_replication.py): each
mistake gets one line that says what to return instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticjob_runtime.training.current import Current
from elasticjob_runtime.training.fsdp_replication import built_parts, round_dim, why_not_in_memory


def test_build_must_return_the_model_and_its_optimizer() -> None:
    with pytest.raises(TypeError, match=r"returned a Linear; return \(model, optimizer\)"):
        built_parts(nn.Linear(2, 2))


def test_a_model_that_was_not_sharded_belongs_to_run_wrap() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"no FSDP2 module in it\); .* use run.wrap"):
        built_parts((model, torch.optim.SGD(model.parameters(), lr=0.1)))


def test_each_round_has_a_mesh_dimension_of_its_own() -> None:
    assert round_dim(3) != round_dim(4)
    assert round_dim(3) == round_dim(3)  # every member of a round names it alike


def test_a_current_name_follows_the_object_of_the_round_in_force() -> None:
    rounds = [nn.Linear(2, 3), nn.Linear(2, 5)]
    model = Current(lambda: rounds[0], "model")
    assert model(torch.zeros(1, 2)).shape == (1, 3)
    rounds.pop(0)  # the next round's model
    assert model(torch.zeros(1, 2)).shape == (1, 5)
    assert model.out_features == 5
    model.training = False  # an attribute set goes to the round's object
    assert rounds[0].training is False


def test_the_log_says_why_the_shards_could_not_move_from_memory() -> None:
    # (step, old rank, old world) by new rank
    lost = why_not_in_memory([(13, 0, 2), (-1, -1, 0)], 13)
    assert lost == "the shards of step 13 held by old rank(s) [1] were lost with their process"
    apart = why_not_in_memory([(13, 0, 2), (12, 1, 2)], 13)
    assert apart == "old rank(s) [1] hold their shards of an older step than 13"
