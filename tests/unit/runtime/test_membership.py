"""The rendezvous rules, decided without etcd: who joins, when a round seals, when to restart."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elasticjob_runtime.membership import (
    Closed,
    Joined,
    Limits,
    Round,
    Wait,
    Write,
    confirm,
    decide_join,
    restart_reason,
)

LIMITS = Limits(min_nodes=2, max_nodes=3, last_call=15.0)


def settle(
    current: Round | None,
    live: frozenset[str],
    order: list[str],
    limits: Limits = LIMITS,
    now: float = 0.0,
    last_joined: dict[str, int] | None = None,
) -> Round | None:
    """Let each node in ``order`` act (writes always win) until nobody writes."""
    seen = dict(last_joined or {})
    for _ in range(50):
        wrote = False
        for node in order:
            decision = decide_join(current, live, node, limits, seen.get(node, 0), now)
            if isinstance(decision, Write):
                current = decision.round
                wrote = True
        if not wrote:
            return current
    raise AssertionError("the rules never settle")


def test_a_round_seals_as_soon_as_every_live_node_has_joined_without_a_last_call() -> None:
    live = frozenset({"a", "b"})
    sealed = settle(None, live, ["a", "b"])
    assert sealed is not None and sealed.complete
    assert set(sealed.participants) == {"a", "b"}
    assert isinstance(decide_join(sealed, live, "a", LIMITS, 0, 0.0), Joined)


def test_a_round_never_seals_below_min_nodes() -> None:
    live = frozenset({"a"})
    current = settle(None, live, ["a"], now=1000.0)
    assert current is not None and not current.complete
    assert isinstance(decide_join(current, live, "a", LIMITS, 0, 10_000.0), Wait)


def test_a_live_node_that_has_not_joined_is_waited_for_only_until_the_last_call() -> None:
    live = frozenset({"a", "b", "c"})
    current = settle(None, live, ["a", "b"], now=0.0)
    assert current is not None and not current.complete and current.last_call == 15.0
    waiting = decide_join(current, live, "a", LIMITS, 0, 1.0)
    assert isinstance(waiting, Wait) and waiting.until == 15.0
    late = decide_join(current, live, "a", LIMITS, 0, 16.0)
    assert isinstance(late, Write) and late.round.complete
    assert late.round.participants == ("a", "b")


def test_a_full_round_seals_at_max_and_extra_nodes_stand_by() -> None:
    live = frozenset({"a", "b", "c", "d"})
    sealed = settle(None, live, ["a", "b", "c", "d"])
    assert sealed is not None and sealed.complete and len(sealed.participants) == 3
    (spare,) = live - set(sealed.participants)
    standby = decide_join(sealed, live, spare, LIMITS, 0, 0.0)
    assert isinstance(standby, Wait) and standby.standby


def test_survivors_of_a_lost_peer_form_the_next_round_without_it() -> None:
    sealed = Round(number=4, participants=("a", "b", "c"), complete=True)
    live = frozenset({"a", "b"})
    assert restart_reason(sealed, live, 4) == "lost peer(s) c"
    after = settle(sealed, live, ["a", "b"], last_joined={"a": 4, "b": 4})
    assert after is not None and after.complete and after.number == 5
    assert set(after.participants) == {"a", "b"}


def test_a_newcomer_opens_a_new_round_and_the_running_nodes_are_told_to_restart() -> None:
    sealed = Round(number=2, participants=("a", "b"), complete=True)
    live = frozenset({"a", "b", "c"})
    assert restart_reason(sealed, live, 2) is None
    opened = decide_join(sealed, live, "c", LIMITS, 0, 0.0)
    assert isinstance(opened, Write) and opened.round.number == 3
    assert restart_reason(opened.round, live, 2) is not None
    after = settle(opened.round, live, ["a", "b", "c"], last_joined={"a": 2, "b": 2})
    assert after is not None and after.complete and set(after.participants) == live


def test_a_closed_rendezvous_admits_nobody_and_restarts_nobody() -> None:
    closed = Round(number=3, participants=("a",), complete=True, closed=True)
    assert isinstance(decide_join(closed, frozenset({"b"}), "b", LIMITS, 0, 0.0), Closed)
    assert restart_reason(closed, frozenset(), 3) is None


def test_round_state_survives_encoding() -> None:
    r = Round(number=7, participants=("x", "y"), complete=False, last_call=12.5)
    assert Round.decode(r.encode()) == r


@given(
    live=st.sets(st.sampled_from("abcdefg"), min_size=1),
    order=st.permutations(list("abcdefg")),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
    now=st.sampled_from([0.0, 100.0]),
)
def test_every_sealed_round_has_between_min_and_max_live_nodes(
    live: set[str], order: list[str], lo: int, extra: int, now: float
) -> None:
    limits = Limits(lo, lo + extra, last_call=15.0)
    current = settle(None, frozenset(live), [n for n in order if n in live], limits, now)
    assert current is not None
    if current.complete:
        assert lo <= len(current.participants) <= lo + extra
        assert set(current.participants) <= live
        assert len(set(current.participants)) == len(current.participants)
    else:
        assert len(live) < lo


def test_a_sealed_round_is_ready_only_once_every_participant_has_confirmed_it() -> None:
    sealed = Round(number=3, participants=("a", "b"), complete=True)
    joined = Joined(3, ("a", "b"), 0)
    live = frozenset({"a", "b"})
    assert confirm(joined, sealed, live, frozenset({"a"})) == "wait"
    assert confirm(joined, sealed, live, frozenset({"a", "b"})) == "ready"


def test_a_round_superseded_or_missing_a_participant_is_withdrawn_from() -> None:
    sealed = Round(number=3, participants=("a", "b"), complete=True)
    joined = Joined(3, ("a", "b"), 0)
    newer = Round(number=4, participants=("c",))
    assert confirm(joined, newer, frozenset({"a", "b", "c"}), frozenset({"a"})) == "withdraw"
    assert confirm(joined, sealed, frozenset({"a"}), frozenset({"a"})) == "withdraw"
    assert confirm(joined, None, frozenset({"a"}), frozenset({"a"})) == "withdraw"


def test_a_round_all_participants_confirmed_stands_even_once_superseded() -> None:
    # Withdrawing then would strand a peer that read "all confirmed" a moment earlier
    # in a round nobody else runs (found as a 1-in-40 hang with three agents).
    joined = Joined(3, ("a", "b"), 1)
    newer = Round(number=4, participants=("c",))
    assert confirm(joined, newer, frozenset({"a", "b", "c"}), frozenset({"a", "b"})) == "ready"
