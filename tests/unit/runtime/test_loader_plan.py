"""The loader's plan: each rank's share of a round as steps of micro-batches, every index
once, and a filler where a rank has no sample left."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_runtime.training.loader import (
    RoundBatches,
    SeededItems,
    StepBatches,
    plan_steps,
    read_here,
)
from elasticjob_runtime.training.sampler import rank_indices
from elasticjob_runtime.training.step_loop import steps_left


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(
    st.integers(1, 300),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 300),
)
def test_the_ranks_plans_cover_the_rest_of_the_epoch_once_in_equal_step_counts(
    samples: int, world: int, batch: int, accumulate: int, consumed: int
) -> None:
    consumed = min(consumed, samples)
    order = list(range(samples))[::-1]
    step = batch * accumulate
    steps = steps_left(samples - consumed, world, step)
    seen: list[int] = []
    for rank in range(world):
        plan = plan_steps(rank_indices(order, consumed, rank, world), steps, step, batch, -1)
        assert len(plan) == steps
        for planned in plan:
            assert planned.micro, "every step has a batch"
            assert all(len(m) <= batch for m in planned.micro)
            if planned.samples == 0:
                assert planned.micro == ((-1,),)
            else:
                seen.extend(i for m in planned.micro for i in m)
    assert sorted(seen) == sorted(order[consumed:])


def test_a_step_is_split_into_micro_batches_and_an_empty_one_is_a_filler() -> None:
    plan = plan_steps([5, 6, 7, 8, 9], 3, 4, 2, filler=0)
    assert plan == [
        StepBatches(((5, 6), (7, 8)), 4),
        StepBatches(((9,),), 1),
        StepBatches(((0,),), 0),
    ]


def test_the_batch_sampler_hands_out_epoch_and_index_keys() -> None:
    batches = RoundBatches()
    batches.load(9, 3, [StepBatches(((5, 6), (7,)), 3)])
    assert list(batches) == [[(9, 3, 5), (9, 3, 6)], [(9, 3, 7)]]
    assert len(batches) == 2
    batches.load(9, 3, [StepBatches(((5, 6), (7,)), 3)], skip=1)  # the first is read here
    assert list(batches) == [[(9, 3, 7)]]


def test_the_training_process_reads_a_rounds_first_micro_batch_only_beside_workers() -> None:
    plan = [StepBatches(((5, 6), (7,)), 3)]
    assert read_here(plan, num_workers=2, has_worker_init=False) == 1
    assert read_here(plan, num_workers=0, has_worker_init=False) == 0  # all read here anyway
    assert read_here(plan, num_workers=2, has_worker_init=True) == 0  # workers set it up
    assert read_here([], num_workers=2, has_worker_init=False) == 0  # nothing to read


def test_an_item_reads_the_same_random_numbers_whoever_reads_it() -> None:
    import torch

    class Noisy:
        def __getitem__(self, index: int) -> float:
            return float(torch.rand(1))

        def __len__(self) -> int:
            return 10

    items = SeededItems(Noisy())  # type: ignore[arg-type]
    first = items[(4, 1, 7)]
    items[(4, 1, 3)]
    assert items[(4, 1, 7)] == first
    assert items[(4, 2, 7)] != first
    assert items[(5, 1, 7)] != first  # another run's seed
