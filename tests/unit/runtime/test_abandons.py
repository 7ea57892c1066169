"""When a worker abandons its round's collectives on its agent's newer round
(worker_rounds.abandons): a lost peer, a round still being built, a member replaced;
never a join or a planned departure, which the ranks switch at a step boundary."""

from __future__ import annotations

from elasticjob_runtime.launch.channel import Assignment
from elasticjob_runtime.training.worker_rounds import abandons


def _round(generation: int, world: int, abort: bool = False) -> Assignment:
    return Assignment(generation, {"RANK": "0", "WORLD_SIZE": str(world)}, abort)


def test_a_member_replaced_a_lost_peer_or_a_round_being_built_is_abandoned() -> None:
    assert abandons(_round(4, 2), 3, 2, building=False)  # a killed worker restarted
    assert abandons(_round(4, 2, abort=True), 3, 3, building=False)  # a node lost
    assert abandons(_round(4, 4), 3, 3, building=True)  # superseded while forming


def test_a_join_a_planned_departure_or_no_newer_round_is_not() -> None:
    assert not abandons(_round(4, 3), 3, 2, building=False)  # a join: 2 -> 3
    assert not abandons(_round(4, 2), 3, 3, building=False)  # a drain: 3 -> 2
    assert not abandons(_round(3, 2, abort=True), 3, 2, building=False)  # this round
    assert not abandons(None, 3, 2, building=True)
