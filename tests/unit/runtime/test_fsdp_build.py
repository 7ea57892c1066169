"""What ``build(mesh)`` must return to ``run.shard`` (training/fsdp_replication.py): each
mistake gets one line that says what to return instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticjob_runtime.training.current import Current
from elasticjob_runtime.training.fsdp_replication import built_parts, round_dims, why_not_in_memory


def test_build_must_return_the_model_and_its_optimizer() -> None:
    with pytest.raises(TypeError, match=r"returned a Linear; return \(model, optimizer\)"):
        built_parts(nn.Linear(2, 2))


def test_a_model_that_was_not_sharded_belongs_to_run_wrap() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"no FSDP2 module in it\); .* use run.wrap"):
        built_parts((model, torch.optim.SGD(model.parameters(), lr=0.1)))


def test_each_round_has_a_mesh_dimension_of_its_own() -> None:
    assert round_dims(3, hsdp=False) != round_dims(4, hsdp=False)
    assert round_dims(3, hsdp=False) == round_dims(3, hsdp=False)  # every member alike
    replicate, shard = round_dims(3, hsdp=True)
    assert replicate != shard and {replicate, shard}.isdisjoint(round_dims(4, hsdp=True))


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
    # (step, old shard, old shards) by new rank
    lost = why_not_in_memory([(13, 0, 2), (-1, -1, 0)], 13)
    assert lost == "shard(s) [1] of step 13 (of 2) were lost with every process that held them"
    apart = why_not_in_memory([(13, 0, 2), (12, 1, 2)], 13)
    assert apart == "shard(s) [1] are held only at an older step than 13"
