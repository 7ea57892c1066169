"""The departure rule, decided without etcd: announce, wait for the others' round, hand
over, exit; or stop as before where handing over cannot work."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from elasticjob_runtime.launch.launcher import without_sigterm
from elasticjob_runtime.rendezvous.departure import (
    EXIT_TIMEOUT_S,
    SEAL_TIMEOUT_S,
    Announce,
    AwaitSeal,
    DepartureView,
    Gone,
    HandOver,
    Standing,
    StopHere,
    decide_departure,
)
from elasticjob_runtime.rendezvous.keys import RendezvousKeys
from elasticjob_runtime.rendezvous.membership import Round, restart_reason

ME = "c"
RUNNING = Round(3, ("a", "b", "c"), complete=True, leader="a")


def view(**changes: object) -> DepartureView:
    standing = Standing(
        me=ME,
        my_round=3,
        participants=("a", "b", "c"),
        current=RUNNING,
        others_live=2,
        min_nodes=1,
    )
    s = {k: v for k, v in changes.items() if k in Standing.__dataclass_fields__}
    rest = {k: v for k, v in changes.items() if k not in s}
    base = DepartureView(
        standing=replace(standing, **s),  # type: ignore[arg-type]
        in_place=True,
        announced=False,
        handed_over=False,
        workers_exited=False,
        waited=0.05,
        since_handover=0.0,
    )
    return replace(base, **rest)  # type: ignore[arg-type]


def test_a_node_of_a_training_round_announces_first() -> None:
    assert decide_departure(view()) == Announce()


def test_it_keeps_training_until_the_others_seal_a_round_without_it() -> None:
    forming = Round(4, leader="a")
    assert decide_departure(view(announced=True)) == AwaitSeal()
    assert decide_departure(view(announced=True, current=forming)) == AwaitSeal()


def test_a_round_sealed_without_it_is_the_hand_over() -> None:
    sealed = Round(4, ("a", "b"), complete=True, leader="a")
    assert decide_departure(view(announced=True, current=sealed)) == HandOver(4)
    # a later round opened before this node looked: the one between was sealed without it
    assert decide_departure(view(announced=True, current=Round(5, leader="b"))) == HandOver(5)


def test_a_hand_over_ends_when_the_workers_have_left() -> None:
    handed = view(announced=True, handed_over=True)
    assert decide_departure(handed) == AwaitSeal()
    assert decide_departure(replace(handed, workers_exited=True)) == Gone()
    late = decide_departure(replace(handed, since_handover=EXIT_TIMEOUT_S + 1))
    assert isinstance(late, StopHere) and "did not leave" in late.why


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"in_place": False}, "cannot regroup in place"),
        ({"current": replace(RUNNING, closed=True)}, "closed"),
        ({"current": None}, "closed"),
        ({"participants": ("c",)}, "only one"),
        ({"others_live": 1, "min_nodes": 2}, "fewer than the 2 needed"),
        ({"workers_exited": True}, "exited"),
        ({"announced": True, "waited": SEAL_TIMEOUT_S + 1}, "sealed no round"),
    ],
)
def test_where_handing_over_cannot_work_it_stops_as_before(
    changes: dict[str, object], said: str
) -> None:
    decided = decide_departure(view(**changes))
    assert isinstance(decided, StopHere) and said in decided.why, decided


def test_a_whole_job_stopping_stops_each_node_once_the_others_leave_too() -> None:
    # announced, then the others announced theirs: nobody is left to form a round
    decided = decide_departure(view(announced=True, others_live=0))
    assert isinstance(decided, StopHere)


def test_leavers_are_present_but_not_live() -> None:
    keys = RendezvousKeys("run")
    found = [keys.member("a"), keys.member("b"), keys.leaving_key("b"), keys.state]
    assert keys.member_names(found) == {"a", "b"}
    assert keys.leaving_names(found) == {"b"}
    assert keys.live_names(found) == {"a"}


def test_an_announced_departure_restarts_the_round_without_calling_the_leaver_lost() -> None:
    assert restart_reason(RUNNING, [], 3, ["c"]) == "c announced its departure"
    assert restart_reason(RUNNING, ["b"], 3, ["c"]) == "lost peer(s) b"
    assert restart_reason(RUNNING, [], 3) is None


def test_sigterm_is_taken_out_of_torchruns_signal_list() -> None:
    assert without_sigterm("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGINT,SIGHUP,SIGQUIT"
    assert without_sigterm("SIGINT, SIGTERM") == "SIGINT"


def test_a_sigterm_asks_for_a_departure_only_while_a_round_trains() -> None:
    from elasticjob_runtime.launch.departing import DepartureRequest

    request = DepartureRequest()
    woken: list[bool] = []
    request.on_taken = lambda: woken.append(True)  # the agent's monitor pass, at once
    assert not request.take()  # no round trains: the agent stops as torch's would
    request.accepting = True
    assert request.take() and request.requested_at is not None
    request.accepting = False
    assert request.take()  # a second SIGTERM changes nothing: the departure goes on
    assert woken == [True]


def test_a_departure_taken_as_the_round_changes_stops_the_node_instead_of_regrouping() -> None:
    from elasticjob_runtime.launch.departing import DepartureRequest

    request = DepartureRequest()
    request.accepting = True
    assert not request.close()  # no SIGTERM: the node regroups with the others
    assert not request.take()  # and one from now on stops the agent at once
    request.accepting = True
    assert request.take()  # taken after the monitor pass looked, before the round changed
    assert request.close()  # the node must stop, not join the next round


class MarkedNode:
    """What Departing reads of a rendezvous: a node the operator marked leaving, whose
    peers sealed round 4 without it."""

    def __init__(self, marked: bool) -> None:
        self.marked = marked
        self.announced = 0

    def is_leaving(self) -> bool:
        return self.marked

    def announce_departure(self) -> None:
        self.announced += 1

    def standing(self) -> Standing:
        after = Round(4, ("a", "b"), complete=True, leader="a")
        return Standing(ME, 3, ("a", "b", "c"), after, others_live=2, min_nodes=1)


def test_a_node_marked_leaving_departs_as_after_a_sigterm_its_announcement_made(
    tmp_path: Path,
) -> None:
    from elasticjob_runtime.launch.channel import AgentChannel, WorkerChannel
    from elasticjob_runtime.launch.departing import Departing, DepartureRequest

    unmarked = Departing(DepartureRequest(), MarkedNode(False), AgentChannel(tmp_path))  # type: ignore[arg-type]
    unmarked.request.accepting = True
    unmarked.follow_mark()
    assert not unmarked.under_way  # never marked, never told to stop: nothing changes

    node = MarkedNode(True)
    departing = Departing(DepartureRequest(), node, AgentChannel(tmp_path))  # type: ignore[arg-type]
    departing.follow_mark()
    assert not departing.under_way  # no round trains: a join stops it (MarkedLeaving)
    departing.request.accepting = True
    departing.follow_mark()
    assert departing.under_way
    departing.step(lambda: True, workers_exited=False)
    assert node.announced == 0  # the operator's mark is the announcement
    assert WorkerChannel(tmp_path, 0).handed_over()  # round 4 went on without it
    assert departing.request.take()  # the SIGTERM that follows changes nothing
