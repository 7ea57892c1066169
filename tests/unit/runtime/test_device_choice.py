"""One GPU per local rank (device_choice.py): the rule, its override, and its errors."""

from __future__ import annotations

import pytest
import torch

from elasticjob_runtime.training.device_choice import choose_device


@pytest.mark.parametrize(
    ("local_rank", "gpus", "asked", "device"),
    [
        (0, 0, None, "cpu"),  # no GPU: the CPU
        (3, 0, None, "cpu"),
        (0, 8, None, "cuda:0"),  # a GPU per local rank, torchrun's convention
        (5, 8, None, "cuda:5"),
        (5, 8, "cpu", "cpu"),  # the override wins
        (5, 8, "cuda", "cuda:5"),  # cuda without an index: the rank's own
        (5, 8, "cuda:0", "cuda:0"),  # every rank on one GPU (gloo only)
        (1, 1, "cuda:0", "cuda:0"),
    ],
)
def test_each_local_rank_gets_its_own_gpu_unless_told_otherwise(
    local_rank: int, gpus: int, asked: str | None, device: str
) -> None:
    assert choose_device(local_rank, gpus, asked) == torch.device(device)


def test_a_local_rank_without_a_gpu_of_its_own_is_an_error_that_says_what_to_do() -> None:
    says = r"local rank 2 has no GPU of its own: this process sees 2"
    with pytest.raises(ValueError, match=says) as e:
        choose_device(2, 2)
    assert "nprocPerNode: gpu" in str(e.value) and "ELASTICJOB_DEVICE=cuda:0" in str(e.value)


@pytest.mark.parametrize(
    ("asked", "gpus", "says"),
    [
        ("gpu", 1, r"'gpu' is not a device: use cpu, cuda or cuda:N"),
        ("mps", 1, r"only cpu and cuda"),
        ("cuda", 0, r"asks for a GPU, but this process sees none"),
        ("cuda:3", 2, r"gives local rank 0 cuda:3, but this process sees 2 GPU"),
        ("cuda", 1, None),  # fine: local rank 0 has cuda:0
    ],
)
def test_a_device_asked_for_that_is_not_there_is_named(
    asked: str, gpus: int, says: str | None
) -> None:
    if says is None:
        assert choose_device(0, gpus, asked) == torch.device("cuda", 0)
        return
    with pytest.raises(ValueError, match=says):
        choose_device(0, gpus, asked)
