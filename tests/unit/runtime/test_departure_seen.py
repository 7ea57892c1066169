"""When an FSDP rank takes a shard copy out of turn (fsdp_replication.someone_leaves):
ranks leave the job when the round ends (worker_rounds.departure_seen)."""

from __future__ import annotations

from elasticjob_runtime.launch.channel import Assignment
from elasticjob_runtime.training.worker_rounds import departure_seen


def _round(generation: int, world_size: int) -> Assignment:
    return Assignment(generation, {"RANK": "0", "WORLD_SIZE": str(world_size)})


def test_a_rank_whose_node_handed_over_knows_it_leaves() -> None:
    assert departure_seen(True, None, 3, 3)


def test_a_smaller_next_round_means_ranks_leave_a_larger_or_equal_one_does_not() -> None:
    assert departure_seen(False, _round(4, 2), 3, 3)  # a drain: 3 -> 2
    assert not departure_seen(False, _round(4, 4), 3, 3)  # a join
    assert not departure_seen(False, _round(4, 3), 3, 3)  # a restart at the same size


def test_no_newer_round_says_nothing() -> None:
    assert not departure_seen(False, None, 3, 3)  # its agent has not delivered yet
    assert not departure_seen(False, _round(3, 2), 3, 3)  # the round it is in
