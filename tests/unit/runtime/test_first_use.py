"""The warm spare's run through torch's first-use paths (launch/first_use.py) leaves
nothing a worker could see."""

from __future__ import annotations

import warnings

import torch

from elasticjob_runtime.launch import first_use


def test_the_exercise_leaves_the_generator_grad_mode_and_threads_as_they_were() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)  # what a script's first draw would be without the exercise
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    with torch.no_grad(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first_use.exercise()
        assert not torch.is_grad_enabled()
    assert said == []
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.rand(3), expected)
