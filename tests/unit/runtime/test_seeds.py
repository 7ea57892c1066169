"""Seeds are a function of where a draw happens: the same step on the same rank draws the
same numbers in any process."""

from __future__ import annotations

import random
import subprocess
import sys

import torch

from elasticjob_runtime.training.seeds import mix, sample_seed, seed_all, step_seed


def test_mix_is_the_same_in_every_process() -> None:
    code = "from elasticjob_runtime.training.seeds import mix; print(mix(1, 2, 3))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other.stdout) == mix(1, 2, 3)
    assert 0 <= mix(1, 2, 3) < 2**64


def test_steps_ranks_and_samples_get_distinct_seeds() -> None:
    seeds = {step_seed(0, s, r) for s in range(1, 50) for r in range(8)}
    assert len(seeds) == 49 * 8
    assert step_seed(0, 5, 1) != step_seed(1, 5, 1)
    assert sample_seed(0, 0, 5) != step_seed(0, 0, 5)
    assert sample_seed(0, 1, 5) != sample_seed(0, 0, 5)


def test_seed_all_replays_torch_and_random_draws() -> None:
    seed_all(step_seed(7, 31, 1))
    first = (torch.rand(4), random.random())
    torch.rand(100)  # what a dropped step drew
    seed_all(step_seed(7, 31, 1))
    again = (torch.rand(4), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]


def test_seed_all_seeds_numpy_once_it_is_imported() -> None:
    import numpy

    seed_all(sample_seed(0, 2, 17))
    first = numpy.random.random(3).tolist()
    seed_all(sample_seed(0, 2, 17))
    assert numpy.random.random(3).tolist() == first


def test_a_fetch_has_a_stream_of_its_own() -> None:
    from elasticjob_runtime.training.seeds import fetch_seed

    assert fetch_seed(0, 5, 1) not in {step_seed(0, 5, 1), sample_seed(0, 5, 1)}
    assert fetch_seed(0, 5, 1) != fetch_seed(0, 6, 1)


def test_a_read_that_seeds_the_generators_gives_them_their_states_back() -> None:
    import numpy

    from elasticjob_runtime.training.seeds import generators_kept

    torch.manual_seed(11)
    random.seed(11)
    numpy.random.seed(11)
    expected = (torch.rand(3), random.random(), numpy.random.random())
    torch.manual_seed(11)
    random.seed(11)
    numpy.random.seed(11)
    with generators_kept():
        seed_all(sample_seed(0, 1, 2))  # what reading a sample does
        torch.rand(50)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and numpy.random.random() == expected[2]
