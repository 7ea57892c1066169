"""The training-loop API's rules: steps per epoch agree on every rank, and only a broken
group counts as a failed collective."""

from __future__ import annotations

from elasticjob_runtime.training.step_loop import steps_left
from elasticjob_runtime.training.worker_rounds import collective_failed


def test_steps_left_is_the_same_on_every_rank_and_counts_the_uneven_end() -> None:
    assert steps_left(1024, 4, 8) == 32
    assert steps_left(1000, 4, 8) == 32  # the last global batch holds 8 samples
    assert steps_left(0, 4, 8) == 0


def test_only_a_broken_group_counts_as_a_failed_collective() -> None:
    import torch.distributed as dist

    gloo = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    )
    assert collective_failed(gloo)
    assert collective_failed(dist.DistNetworkError("store gone"))
    assert not collective_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not collective_failed(ValueError("Connection closed by peer"))


def test_registered_state_takes_statefuls_under_names_of_their_own() -> None:
    import pytest
    import torch

    from elasticjob_runtime.training.state import registered_state

    params = [torch.nn.Parameter(torch.ones(2))]
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(params, lr=0.1), 10)
    assert registered_state({"scheduler": sched}) == {"scheduler": sched}
    with pytest.raises(TypeError, match=r"state\['lr'\] is a float, which has no state_dict"):
        registered_state({"lr": 0.1})
    with pytest.raises(ValueError, match="state name 'model' is not allowed"):
        registered_state({"model": sched})


def test_a_finished_epoch_reads_as_the_next_ones_start() -> None:
    from elasticjob_runtime.training.sampler import ElasticSampler
    from elasticjob_runtime.training.state import sampler_position

    done, moved_on = ElasticSampler(10, 0, 1), ElasticSampler(10, 0, 1)
    done.advance(10)
    moved_on.set_epoch(1)
    assert sampler_position(done) == sampler_position(moved_on)
    midway = ElasticSampler(10, 0, 1)
    midway.advance(4)
    assert sampler_position(midway)["consumed"] == 4
