"""A rank's ledger keeper: the moments it books, the causes it infers, the ledger a
group of new processes starts from (the run's published one, or a new run's)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.progress import ProgressTarget
from elasticjob_runtime.goodput import keeper
from elasticjob_runtime.goodput import ledger as gl
from elasticjob_runtime.goodput.ledger import Cause

ETCD_ENV = {
    "TORCHELASTIC_RUN_ID": "run-1",
    contract.RDZV_BACKEND: "etcd-v3",
    contract.RDZV_ENDPOINT: "127.0.0.1:2379",
}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("failed", "old", "new", "cause"),
    [
        (True, 4, 4, Cause.FAILURE),
        (True, 4, 3, Cause.FAILURE),  # a lost node: the collective broke first
        (False, 2, 4, Cause.JOIN),
        (False, 4, 2, Cause.DEPARTURE),
        (False, 4, 4, Cause.FAILURE),
    ],
)
def test_a_rank_names_the_cause_of_a_regroup_from_what_it_saw(
    failed: bool, old: int, new: int, cause: Cause
) -> None:
    assert keeper.regroup_cause(failed, old, new) == cause


@pytest.mark.parametrize(
    ("failed", "told", "cause"),
    [
        (True, "crash", Cause.CRASH),  # a survivor saw a broken collective; the round knew
        (True, "node-lost", Cause.NODE_LOST),
        (False, "departure", Cause.DEPARTURE),
        (False, "join", Cause.JOIN),
        (True, "hang", Cause.HANG),
        (True, "start", Cause.FAILURE),  # names no recovery: what the rank saw
        (True, "a-cause-from-a-newer-runtime", Cause.FAILURE),
    ],
)
def test_a_rank_takes_the_cause_its_round_was_opened_for(
    failed: bool, told: str, cause: Cause
) -> None:
    assert keeper.regroup_cause(failed, 4, 4, told) == cause


def test_a_group_restarted_for_a_hang_books_a_hang() -> None:
    published = gl.committed(gl.committed(gl.opened(0.0), 1, 1.0), 2, 2.0)
    assert keeper.group_start(published, 0.0, "hang").recovering == gl.Recovery("hang", 2.0)
    assert keeper.group_start(published, 0.0, None).recovering == gl.Recovery("restart", 2.0)


def test_a_resync_is_a_divergence_recovery_up_to_the_next_step() -> None:
    clock = Clock(10.0)
    kept = keeper.LedgerKeeper(gl.committed(gl.committed(gl.opened(0.0), 1, 1.0), 2, 2.0), clock)
    clock.now = 2.5
    kept.resynced(began=2.1)
    clock.now = 3.6
    kept.committed(3)
    assert kept.ledger.recoveries == {"divergence": 1}
    # from step 2 to step 3: 1.6 s, of which one typical step (1 s) trained
    assert kept.ledger.longest_pause == pytest.approx(0.6)


def test_the_keeper_books_a_regroup_from_its_start_to_its_end_and_the_step_after() -> None:
    clock = Clock(100.0)
    k = keeper.LedgerKeeper(gl.opened(90.0), clock)
    for step in (1, 2, 3):
        clock.now += 1.0
        k.committed(step)
    clock.now += 0.25
    k.saved()  # step 3's checkpoint
    clock.now += 0.15
    k.regroup_began()
    clock.now += 0.1
    k.group_changed(Cause.JOIN)  # the next round is known: booked before the group forms
    assert k.ledger.recovering == gl.Recovery("join", 103.25)
    clock.now += 0.1
    k.regroup_began()  # a retry of the regroup: still the first one's start
    k.group_changed(Cause.JOIN)  # and the same recovery
    clock.now += 0.3
    k.regrouped()
    clock.now += 1.0
    k.committed(4)
    book = k.ledger
    assert book.startup == pytest.approx(11.0)
    assert book.checkpoint == pytest.approx(0.25)
    assert book.lost == pytest.approx(0.15)
    assert book.paused == {"join": pytest.approx(0.5)}
    assert book.training == pytest.approx(3.0)
    assert book.recoveries == {"join": 1}
    assert book.last == gl.Recovered("join", pytest.approx(0.65), 4, pytest.approx(104.9))
    assert book.accounted == pytest.approx(book.wall)
    assert gl.decode(k.encoded()) == gl.decode(gl.encode(book))


def test_a_new_process_opens_its_own_ledger_at_its_agents_start() -> None:
    k = keeper.fresh_keeper({contract.AGENT_STARTED: "1000.5"})
    assert k.ledger.opened == 1000.5 and not k.ledger.started


def test_a_bad_agent_start_is_this_processes_start() -> None:
    started = keeper.process_started()
    k = keeper.fresh_keeper({contract.AGENT_STARTED: "not a time"})
    assert started is not None and k.ledger.opened == pytest.approx(started, abs=0.05)


def test_a_group_of_new_processes_takes_the_published_ledger_on_as_a_restart() -> None:
    published = gl.committed(gl.committed(gl.opened(0.0), 1, 10.0), 2, 11.0)
    seen: list[ProgressTarget] = []

    def read(target: ProgressTarget) -> dict[str, Any]:
        seen.append(target)
        return gl.encode(published)

    found = keeper.read_published(ETCD_ENV, read)
    assert seen[0].run_id == "run-1" and found == gl.decode(gl.encode(published))
    assert found is not None
    restart = keeper.group_start(found, earliest=15.0)
    assert restart.recoveries == {"restart": 1}
    restart = gl.committed(restart, 3, 21.0)
    assert restart.paused == {"restart": pytest.approx(9.0)}  # 11 -> 21, less a 1 s step


def test_a_new_run_opens_at_the_earliest_start_among_its_ranks() -> None:
    assert keeper.group_start(None, earliest=7.5) == gl.opened(7.5)


def test_a_malformed_or_absent_published_ledger_or_no_etcd_is_none() -> None:
    assert keeper.read_published(ETCD_ENV, lambda _t: {"opened": -1}) is None
    assert keeper.read_published(ETCD_ENV, lambda _t: None) is None

    def no_read(_target: ProgressTarget) -> dict[str, Any]:
        raise AssertionError("no etcd to read")

    assert keeper.read_published({}, no_read) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["commit", "redo", "regroup", "save", "read"]),
            st.floats(min_value=-0.5, max_value=3.0),  # a clock may step back
        ),
        max_size=60,
    )
)
def test_the_keepers_steady_commits_book_exactly_what_the_pure_rules_do(
    events: list[tuple[str, float]],
) -> None:
    """The keeper skips building a Ledger for a steady step: the same figures, bit for
    bit, as the pure rules applied one moment at a time, whenever it is read."""
    clock = Clock(1000.0)
    kept = keeper.LedgerKeeper(gl.opened(1000.0), clock)
    pure, step = gl.opened(1000.0), 0
    for kind, gap in events:
        clock.now += gap
        if kind == "commit":
            step += 1
            kept.committed(step)
            pure = gl.committed(pure, step, clock.now)
        elif kind == "redo":
            kept.committed(max(1, step - 2))
            pure = gl.committed(pure, max(1, step - 2), clock.now)
        elif kind == "regroup":  # noticed, its round known and done, all at one moment
            kept.regroup_began()
            kept.group_changed(Cause.FAILURE)
            kept.regrouped()
            pure = gl.paused(gl.interrupted(pure, Cause.FAILURE, clock.now), clock.now)
        elif kind == "save":
            kept.saved()
            pure = gl.saved(pure, clock.now)
        else:
            assert kept.ledger == pure
    assert kept.ledger == pure
