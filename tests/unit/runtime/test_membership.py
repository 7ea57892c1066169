"""The rendezvous rules, decided without etcd: who opens, who enters, when the leader
seals, who stands by, when to restart."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_runtime import contract
from elasticjob_runtime.rendezvous.membership import (
    FIRST_ROUND,
    CheckSealed,
    Closed,
    Enter,
    Follow,
    Joined,
    Lead,
    Limits,
    Open,
    Rejoin,
    Round,
    RoundCause,
    Seal,
    Standby,
    Wait,
    awaited,
    binding_round,
    decide_join,
    decide_lead,
    decide_next,
    decide_seal,
    decide_standby,
    decode_participants,
    desired_nodes,
    encode_participants,
    gone_on_without,
    joined_by_record,
    leader_of,
    restart_cause,
    restart_reason,
    short_of_desired,
    takes_over,
)

LIMITS = Limits(min_nodes=2, max_nodes=3, last_call=15.0)


@dataclass
class Etcd:
    """The keys the handler keeps, in memory: the round key, each round's joins in the
    order they were put, and the sealed records."""

    state: Round | None = None
    joins: dict[int, list[str]] = field(default_factory=dict)
    sealed: dict[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class Node:
    name: str
    last_joined: int = 0
    entered: int | None = None
    joined: Joined | None = None


def step(etcd: Etcd, node: Node, live: frozenset[str], limits: Limits, now: float) -> bool:
    """One action of ``node`` as the handler takes it; True if it changed anything."""
    decision = decide_next(etcd.state, node.name, limits, node.last_joined, node.entered, None)
    if isinstance(decision, CheckSealed):
        record = etcd.sealed.get(decision.number, ())
        node.joined, node.entered = joined_by_record(decision.number, record, node.name), None
        return True
    if isinstance(decision, Joined):
        node.joined, node.entered = decision, None
        return True
    if isinstance(decision, Standby):
        standby = decide_standby(decision.round, node.name, live)
        if isinstance(standby, Wait):
            return False
        decision = standby
    if isinstance(decision, Open):
        etcd.state = decision.round
        decision = Enter(decision.round.number)
    if isinstance(decision, Enter):
        etcd.joins.setdefault(decision.number, []).append(node.name)
        node.entered = decision.number
        return True
    if isinstance(decision, Lead) and etcd.state is not None:
        joins = etcd.joins.get(decision.number, [])
        first = decision.number == FIRST_ROUND
        verdict = decide_seal(joins, live, limits, None, now, first_round=first)
        if isinstance(verdict, Seal):
            etcd.state = Round(decision.number, verdict.participants, True, leader=node.name)
            etcd.sealed[decision.number] = verdict.participants
            return True
    return False


def settle(
    nodes: list[Node], live: frozenset[str], limits: Limits = LIMITS, etcd: Etcd | None = None
) -> Etcd:
    """Let the nodes act in turn until none changes anything."""
    etcd = etcd or Etcd()
    for _ in range(200):
        if not any([step(etcd, n, live, limits, 0.0) for n in nodes if n.joined is None]):
            return etcd
    raise AssertionError("the rules never settle")


def test_the_first_node_opens_and_leads_the_others_enter_and_follow() -> None:
    assert decide_join(None, "a", LIMITS, 0, None) == Open(
        Round(1, leader="a", cause=RoundCause.START), "first node opens a round"
    )
    forming = Round(1, leader="a")
    assert decide_join(forming, "b", LIMITS, 0, None) == Enter(1)
    assert decide_join(forming, "b", LIMITS, 0, 1) == Follow(1, "a")
    assert decide_join(forming, "a", LIMITS, 0, 1) == Lead(1)


def test_a_round_seals_as_soon_as_every_live_node_has_entered_without_a_last_call() -> None:
    nodes = [Node("a"), Node("b")]
    etcd = settle(nodes, frozenset({"a", "b"}))
    assert etcd.state is not None and etcd.state.complete
    assert [n.joined.world_size if n.joined else None for n in nodes] == [2, 2]
    assert sorted(n.joined.rank for n in nodes if n.joined) == [0, 1]


def test_a_round_never_seals_below_min_nodes() -> None:
    verdict = decide_seal(["a"], frozenset({"a"}), LIMITS, deadline=1.0, now=10_000.0)
    assert isinstance(verdict, Wait) and verdict.until is None
    assert "1 of at least 2 nodes have joined" in verdict.why


def test_a_live_node_that_has_not_entered_is_waited_for_only_until_the_last_call() -> None:
    live = frozenset({"a", "b", "c"})
    waiting = decide_seal(["a", "b"], live, LIMITS, deadline=None, now=100.0)
    assert waiting == Wait(115.0, "waiting for live nodes that have not joined yet")
    assert decide_seal(["a", "b"], live, LIMITS, deadline=115.0, now=114.9) == waiting
    assert decide_seal(["a", "b"], live, LIMITS, deadline=115.0, now=115.0) == Seal(("a", "b"))


def test_the_first_round_waits_for_the_nodes_the_job_asked_for_until_the_last_call() -> None:
    """On kind, worker-0 sealed round 1 alone (min 1) while worker-1's pod was starting,
    and trained the whole short job at world 1: the job asked for 2."""
    limits = Limits(min_nodes=1, max_nodes=2, last_call=15.0, desired=2)
    alone = frozenset({"a"})
    waiting = decide_seal(["a"], alone, limits, None, 100.0, first_round=True)
    assert waiting == Wait(115.0, "1 of the 2 nodes the job asked for have joined")
    assert decide_seal(["a"], alone, limits, 115.0, 114.9, first_round=True) == waiting
    both = frozenset("ab")
    assert decide_seal(["a", "b"], both, limits, 115.0, 101.0, first_round=True) == Seal(("a", "b"))
    # bounded: the job starts with those that came
    assert decide_seal(["a"], alone, limits, 115.0, 115.0, first_round=True) == Seal(("a",))
    # a later round (a regroup after a loss) waits for nobody who is not live
    assert decide_seal(["a"], alone, limits, None, 100.0) == Seal(("a",))
    # without a count, as before: every live node in is enough
    unsaid = Limits(1, 2, 15.0)
    assert decide_seal(["a"], alone, unsaid, None, 100.0, first_round=True) == Seal(("a",))


def test_the_first_round_waits_for_the_job_s_pods_longer_than_a_regroup_waits() -> None:
    """On kind, worker-1's first packets to etcd were dropped for 21 s (its node admitted
    the new pod late): the first round's own last call covers that, a regroup's does not."""
    limits = Limits(min_nodes=1, max_nodes=2, last_call=15.0, desired=2, first_round_wait=60.0)
    alone = frozenset({"a"})
    waiting = decide_seal(["a"], alone, limits, None, 100.0, first_round=True)
    assert waiting == Wait(160.0, "1 of the 2 nodes the job asked for have joined")
    assert decide_seal(["a"], alone, limits, 160.0, 121.0, first_round=True) == waiting
    assert decide_seal(["a"], alone, limits, 160.0, 160.0, first_round=True) == Seal(("a",))
    assert short_of_desired(limits, True, 1) == (
        "sealed the first round with 1 of the 2 nodes the job asked for: the others had not "
        "joined 60s after the first 1; they join the next round when they come (raise "
        "--rdzv-conf first_round_timeout if your nodes start further apart)"
    )
    # a live node that has not entered a later round is waited for the last call only
    both = frozenset("ab")
    assert decide_seal(["a"], both, limits, None, 100.0) == Wait(
        115.0, "waiting for live nodes that have not joined yet"
    )
    # without the job's count nothing is awaited beyond the live nodes
    unsaid = Limits(1, 2, 15.0, first_round_wait=60.0)
    waited = decide_seal(["a"], both, unsaid, None, 100.0, first_round=True)
    assert isinstance(waited, Wait) and waited.until == 115.0


def test_a_node_that_starts_late_is_in_the_first_round_of_a_job_that_asked_for_it() -> None:
    a, b = Node("a"), Node("b")
    asked = Limits(1, 2, 15.0, desired=2)
    etcd = settle([a], frozenset("a"), asked)
    assert a.joined is None and etcd.state == Round(1, leader="a", cause="start")  # waits for b
    settle([a, b], frozenset("ab"), asked, etcd)
    assert a.joined == Joined(1, ("a", "b"), 0) and b.joined == Joined(1, ("a", "b"), 1)
    # without the count a seals alone, and b comes to a running round: a second round
    a, b = Node("a"), Node("b")
    etcd = settle([a], frozenset("a"), Limits(1, 2, 15.0))
    assert a.joined == Joined(1, ("a",), 0)
    settle([b], frozenset("ab"), Limits(1, 2, 15.0), etcd)
    assert etcd.state == Round(2, leader="b", cause="join")


def test_the_awaited_count_stays_within_min_and_max() -> None:
    assert awaited(Limits(2, 4, 15.0, desired=3), first_round=True) == 3
    assert awaited(Limits(2, 4, 15.0, desired=9), first_round=True) == 4
    assert awaited(Limits(2, 4, 15.0, desired=1), first_round=True) == 2
    assert awaited(Limits(2, 4, 15.0, desired=3), first_round=False) == 2
    assert awaited(Limits(2, 4, 15.0), first_round=True) == 2


def test_the_desired_count_is_read_from_the_operators_variable() -> None:
    assert desired_nodes({}) is None
    assert desired_nodes({contract.DESIRED_NODES: ""}) is None
    assert desired_nodes({contract.DESIRED_NODES: " 3 "}) == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=re.escape(f"ELASTICJOB_DESIRED_NODES={bad!r}: ")):
            desired_nodes({contract.DESIRED_NODES: bad})


def test_the_leader_says_when_its_first_round_starts_short_of_the_count() -> None:
    limits = Limits(1, 4, 15.0, desired=3)
    said = short_of_desired(limits, True, 2)
    assert said is not None
    assert said.startswith("sealed the first round with 2 of the 3 nodes the job asked for")
    assert "first_round_timeout" in said
    assert short_of_desired(limits, True, 3) is None
    assert short_of_desired(limits, False, 1) is None


def test_a_full_round_seals_at_max_in_entry_order_and_extra_nodes_stand_by() -> None:
    live = frozenset("abcde")
    assert decide_seal(list("dabce"), live, LIMITS, None, 0.0) == Seal(("d", "a", "b"))
    full = Round(1, ("d", "a", "b"), complete=True, leader="d")
    assert decide_join(full, "e", LIMITS, 0, 1) == Standby(full)
    assert decide_standby(full, "e", live).standby  # type: ignore[union-attr]


def test_an_entrant_whose_lease_is_gone_is_left_out_of_the_seal() -> None:
    assert decide_seal(["a", "x", "b"], frozenset({"a", "b"}), LIMITS, None, 0.0) == Seal(
        ("a", "b")
    )


def test_a_node_standing_by_opens_the_next_round_once_a_participant_is_lost() -> None:
    full = Round(1, ("a", "b", "c"), complete=True, leader="a")
    step = decide_standby(full, "e", frozenset({"a", "c", "e"}))
    assert step == Open(Round(2, leader="e", cause=RoundCause.NODE_LOST), "lost b")


def test_survivors_of_a_lost_peer_open_the_next_round_and_form_it_without_it() -> None:
    sealed = Round(1, ("a", "b", "c"), complete=True, leader="a")
    live = frozenset({"a", "c"})
    assert restart_reason(sealed, ["b"], my_round=1) == "lost peer(s) b"
    nodes = [Node("a", last_joined=1), Node("c", last_joined=1)]
    etcd = settle(nodes, live, etcd=Etcd(state=sealed, sealed={1: sealed.participants}))
    assert etcd.state is not None and etcd.state.number == 2
    assert set(etcd.state.participants) == {"a", "c"}


def test_a_newcomer_opens_a_new_round_and_the_running_nodes_are_told_to_restart() -> None:
    running = Round(1, ("a", "b"), complete=True, leader="a")
    assert decide_join(running, "c", LIMITS, 0, None) == Open(
        Round(2, leader="c", cause=RoundCause.JOIN), "joining a round with room"
    )
    assert restart_reason(Round(2, leader="c"), [], my_round=1) is not None
    assert restart_reason(running, [], my_round=1) is None


def test_a_closed_rendezvous_admits_nobody_and_restarts_nobody() -> None:
    closed = Round(3, ("a",), complete=True, closed=True)
    assert decide_join(closed, "b", LIMITS, 0, None) == Closed(finished=False)
    assert restart_reason(closed, ["a"], my_round=3) is None


def test_a_run_closed_because_training_finished_says_so_and_keeps_saying_it() -> None:
    finished = Round(3, ("a",), complete=True, closed=True, finished=True)
    assert decide_join(finished, "b", LIMITS, 0, None) == Closed(finished=True)
    assert Round.decode(finished.encode()) == finished
    # a record written before the flag existed reads as closed, not finished
    assert Round.decode(b'{"number": 3, "closed": true}').finished is False


def test_the_earliest_live_entrant_leads_once_the_opener_is_gone() -> None:
    assert leader_of("a", ["a", "b", "c"], frozenset("abc")) == "a"
    assert leader_of("a", ["a", "c", "b"], frozenset("bc")) == "c"
    assert leader_of("a", ["a"], frozenset()) is None


def test_round_state_and_the_sealed_record_survive_encoding() -> None:
    r = Round(7, ("x", "y"), complete=True, closed=False, leader="x")
    assert Round.decode(r.encode()) == r
    assert decode_participants(encode_participants(("y", "x"))) == ("y", "x")


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(
    number=st.integers(1, 50),
    participants=st.lists(st.sampled_from("abcdef"), unique=True, max_size=4),
    complete=st.booleans(),
    me=st.sampled_from("abcdefg"),
    last_joined=st.integers(0, 50),
    entered=st.none() | st.integers(0, 50),
)
def test_a_forming_round_is_never_replaced_by_a_newer_one(
    number: int,
    participants: list[str],
    complete: bool,
    me: str,
    last_joined: int,
    entered: int | None,
) -> None:
    # Rounds that superseded each other while still forming were the livelock at 64
    # nodes: latecomers re-opened rounds for ever. Only a sealed round may be followed.
    current = Round(number, tuple(participants) if complete else (), complete, leader="a")
    decision = decide_join(current, me, Limits(1, 4, 1.0), last_joined, entered)
    if not complete:
        assert not isinstance(decision, Open)
    if isinstance(decision, Open):
        assert decision.round.number == number + 1 and decision.round.leader == me


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(
    order=st.permutations(["a", "b", "c", "d", "e"]),
    live_count=st.integers(1, 5),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_every_live_node_ends_in_one_sealed_round_of_min_to_max_live_nodes(
    order: list[str], live_count: int, lo: int, extra: int
) -> None:
    limits = Limits(lo, lo + extra, last_call=15.0)
    live = frozenset(order[:live_count])
    nodes = [Node(name) for name in order if name in live]
    etcd = settle(nodes, live, limits)
    if live_count < lo:
        assert all(n.joined is None for n in nodes)
        return
    rounds = {n.joined.number for n in nodes if n.joined}
    assert len(rounds) == 1
    world = next(n.joined.participants for n in nodes if n.joined)
    assert lo <= len(world) <= lo + extra and set(world) <= live
    standing_by = [n for n in nodes if n.joined is None]
    assert len(world) + len(standing_by) == live_count
    assert not standing_by or len(world) == lo + extra  # only a full round leaves nodes out
    assert etcd.sealed[rounds.pop()] == world


def test_a_node_that_reads_its_sealed_round_only_after_a_newer_one_opened_still_runs_it() -> None:
    # b entered round 1 and was sealed into it; c then opened round 2 before b read the
    # round key. b must run round 1 (a runs it and waits for b), not walk away to 2.
    etcd = Etcd(
        state=Round(2, leader="c"),
        joins={1: ["a", "b"], 2: ["c"]},
        sealed={1: ("a", "b")},
    )
    b = Node("b", entered=1)
    assert step(etcd, b, frozenset("abc"), LIMITS, 0.0)
    assert b.joined == Joined(1, ("a", "b"), 1)
    assert restart_reason(etcd.state, [], my_round=1) is not None  # then straight to round 2


def test_peers_that_sealed_a_newer_round_without_this_node_have_left_its_group() -> None:
    ours = ("a", "b")
    # b was cut off; a sealed round 4 alone: b's round 3 is dead, whatever gloo says
    assert gone_on_without(Round(4, ("a",), complete=True), "b", 3, ours) == ["a"]
    # ... and a round after that is already forming
    assert gone_on_without(Round(5, ("c",)), "b", 3, ours) == ["a"]
    # a newcomer opened the next round: everyone is still in round 3 and will join it
    assert gone_on_without(Round(4, ("c",)), "b", 3, ours) == []
    assert gone_on_without(Round(4, ("a", "b"), complete=True), "b", 3, ours) == []
    assert gone_on_without(Round(3, ours, complete=True), "b", 3, ours) == []
    assert gone_on_without(Round(4, ("a",), complete=True, closed=True), "b", 3, ours) == []
    assert gone_on_without(None, "b", 3, ours) == []


def test_a_node_reads_the_sealed_record_of_its_round_once_the_round_key_is_past_it() -> None:
    assert binding_round(Round(3, leader="c"), entered=2, last_joined=1) == 2
    assert decide_next(Round(3, leader="c"), "b", LIMITS, 1, 2, None) == CheckSealed(2)
    # its round is still the current one, it never entered, or it already ran it
    assert binding_round(Round(2, leader="a"), entered=2, last_joined=1) is None
    assert binding_round(Round(3, leader="c"), entered=None, last_joined=1) is None
    assert binding_round(Round(3, leader="c"), entered=2, last_joined=2) is None
    assert binding_round(None, entered=2, last_joined=1) is None


def test_the_sealed_record_binds_only_the_nodes_in_it_at_their_rank() -> None:
    assert joined_by_record(2, ("a", "b"), "b") == Joined(2, ("a", "b"), 1)
    assert joined_by_record(2, ("a", "b"), "c") is None


def test_a_follower_takes_over_only_when_its_leader_is_gone_and_it_entered_first() -> None:
    joins = ["a", "b", "c"]
    assert not takes_over("b", "a", joins, frozenset("abc"))  # the leader lives
    assert takes_over("b", "a", joins, frozenset("bc"))
    assert not takes_over("c", "a", joins, frozenset("bc"))  # b entered before it
    assert takes_over("c", "a", joins, frozenset("c"))


def test_a_node_that_took_over_a_round_leads_it_though_the_round_key_names_its_opener() -> None:
    forming = Round(2, leader="a")
    assert decide_next(forming, "b", LIMITS, 1, 2, leading=None) == Follow(2, "a")
    assert decide_next(forming, "b", LIMITS, 1, 2, leading=2) == Lead(2)
    assert decide_next(forming, "b", LIMITS, 1, 2, leading=1) == Follow(2, "a")  # an old one
    assert decide_next(forming, "b", LIMITS, 1, None, leading=2) == Enter(2)  # enter first


def test_a_leader_whose_own_lease_ran_out_enters_again_before_it_seals() -> None:
    assert decide_lead("a", ["b", "c"], frozenset("bc"), LIMITS, None, 0.0) == Rejoin()
    live = frozenset("abc")
    joins = ["a", "b", "c"]
    assert decide_lead("a", joins, live, LIMITS, None, 0.0) == decide_seal(
        joins, live, LIMITS, None, 0.0
    )


def test_a_round_says_why_its_opener_opened_it_and_the_sealed_round_keeps_it() -> None:
    running = Round(1, ("a", "b"), complete=True, leader="a", cause="start")
    # a's own worker exited: its agent comes back to the running round it is in
    opened = decide_join(running, "a", LIMITS, 1, None)
    assert isinstance(opened, Open) and opened.round.cause == RoundCause.CRASH
    # the others join the round it opened, and learn why from it once sealed
    sealed = Round(2, ("a", "b"), complete=True, leader="a", cause=RoundCause.CRASH)
    assert decide_join(sealed, "b", LIMITS, 1, 2) == Joined(2, ("a", "b"), 1, "crash")
    assert Round.decode(sealed.encode()) == sealed
    # an older runtime's round key has no cause: not known
    assert Round.decode(b'{"number": 2, "participants": ["a"], "complete": true}').cause == ""


def test_a_node_that_restarts_for_a_lost_peer_or_a_departure_says_so() -> None:
    mine = Round(3, ("a", "b", "c"), complete=True, leader="a")
    assert restart_cause(mine, ["b"], 3) == RoundCause.NODE_LOST
    assert restart_cause(mine, [], 3, leaving=["c"]) == RoundCause.DEPARTURE
    assert restart_cause(mine, [], 3) is None
    # a newer round is another's: it says its own cause
    assert restart_cause(Round(4, leader="c"), ["b"], 3) is None
    assert restart_cause(None, [], 3) is None
