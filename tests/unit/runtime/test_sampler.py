"""ElasticSampler: every index exactly once per epoch, whatever the resizes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_runtime.training.sampler import (
    ElasticSampler,
    advance_consumed,
    epoch_order,
    rank_indices,
    rank_positions,
)

# A segment of training at one world size: (world_size, per-rank batch, steps).
segments = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 7), st.integers(0, 12)), min_size=0, max_size=8
)


def run_segments(num_samples: int, plan: list[tuple[int, int, int]]) -> tuple[Counter[int], int]:
    """Simulate ranks taking batches at changing world sizes; return positions seen and count."""
    seen: Counter[int] = Counter()
    consumed = 0
    for world, batch, steps in plan:
        per_rank = [list(rank_positions(num_samples, consumed, r, world)) for r in range(world)]
        for step in range(steps):
            taken = 0
            for r in range(world):
                chunk = per_rank[r][step * batch : (step + 1) * batch]
                seen.update(chunk)
                taken += len(chunk)
            # the positions taken in one step are exactly the next window of the order
            assert taken == min(world * batch, num_samples - consumed)
            consumed = advance_consumed(num_samples, consumed, world * batch)
    return seen, consumed


@settings(max_examples=400, deadline=None)
@given(num_samples=st.integers(0, 200), plan=segments, last_world=st.integers(1, 9))
def test_any_sequence_of_resizes_sees_every_index_exactly_once(
    num_samples: int, plan: list[tuple[int, int, int]], last_world: int
) -> None:
    seen, consumed = run_segments(num_samples, plan)
    # finish the epoch at the last world size
    for r in range(last_world):
        seen.update(rank_positions(num_samples, consumed, r, last_world))
    assert sorted(seen) == list(range(num_samples))
    assert all(n == 1 for n in seen.values())


@settings(max_examples=200, deadline=None)
@given(num_samples=st.integers(0, 200), plan=segments)
def test_positions_taken_are_a_prefix_of_the_order(
    num_samples: int, plan: list[tuple[int, int, int]]
) -> None:
    seen, consumed = run_segments(num_samples, plan)
    assert set(seen) == set(range(consumed))
    assert all(n == 1 for n in seen.values())


@settings(max_examples=100, deadline=None)
@given(num_samples=st.integers(0, 300), seed=st.integers(0, 2**31), epoch=st.integers(0, 1000))
def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch(
    num_samples: int, seed: int, epoch: int
) -> None:
    order = epoch_order(num_samples, seed, epoch)
    assert sorted(order) == list(range(num_samples))
    assert order == epoch_order(num_samples, seed, epoch)


def test_epochs_use_different_orders() -> None:
    assert epoch_order(100, 7, 0) != epoch_order(100, 7, 1)


def test_resume_after_resize_from_state_dict_covers_the_epoch() -> None:
    n, batch = 50, 3
    samplers = [ElasticSampler(n, r, 3, seed=5) for r in range(3)]
    seen: list[int] = []
    iters = [iter(s) for s in samplers]
    for _ in range(4):  # four steps at world size 3
        for it in iters:
            seen.extend(next(it) for _ in range(batch))
        for s in samplers:
            s.advance(3 * batch)
    state = samplers[0].state_dict()
    assert state["consumed"] == 36
    resized = [ElasticSampler(n, r, 2, seed=5) for r in range(2)]
    for s in resized:
        s.load_state_dict(state)
        s.set_epoch(0)  # the loop's set_epoch for the same epoch keeps the position
    for s in resized:
        seen.extend(s)
    assert sorted(seen) == list(range(n))
    assert len(resized[0]) + len(resized[1]) == n - 36


def test_rank_indices_map_positions_through_the_order() -> None:
    order = [4, 2, 0, 3, 1]
    assert rank_indices(order, 1, 0, 2) == [2, 3]
    assert rank_indices(order, 1, 1, 2) == [0, 1]


def test_new_epoch_starts_from_the_beginning() -> None:
    s = ElasticSampler(10, 0, 1)
    s.advance(10)
    assert len(s) == 0
    s.set_epoch(1)
    assert sorted(s) == list(range(10))


def test_state_for_another_dataset_is_refused_with_a_clear_message() -> None:
    s = ElasticSampler(10, 0, 1)
    with pytest.raises(ValueError, match="is for 20 samples but this dataset has 10"):
        s.load_state_dict(ElasticSampler(20, 0, 1).state_dict())


def test_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        ElasticSampler(10, 2, 2)


def test_rank_and_world_size_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    s = ElasticSampler(23)
    assert (s.rank, s.world_size) == (2, 5)
    assert list(s) == [epoch_order(23, 0, 0)[p] for p in range(2, 23, 5)]
