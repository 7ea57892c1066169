"""The member lease's rules without etcd: refresh timing, what the user is told."""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_runtime.rendezvous.leases import (
    DEFAULT_LEASE_TTL,
    LAPSE_WINDOW_S,
    LAPSES_BEFORE_LEAVING,
    LATE_WARNING_EVERY_S,
    granted_ttl_message,
    job_lease_due,
    keep_alive_timing,
    keeper_cut_off,
    keeper_recheck_after,
    lapses_message,
    late_refresh_warning,
    leaves_after_lapse,
    notice_within,
)


def test_a_lost_node_is_noticed_within_about_a_second_by_default() -> None:
    assert DEFAULT_LEASE_TTL == 1
    assert notice_within(DEFAULT_LEASE_TTL) == 1.5  # plus etcd's 500 ms expiry check


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(st.integers(min_value=1, max_value=3600))
def test_after_a_stuck_refresh_the_next_one_is_done_before_the_lease_runs_out(ttl: int) -> None:
    t = keep_alive_timing(ttl)
    # last refresh at 0; the next, at one interval, hangs for its whole timeout; the one
    # after that must have answered (or failed) before the TTL is up
    assert 2 * (t.interval + t.timeout) < ttl
    assert ttl / t.interval >= 4  # refreshed at least four times per TTL
    assert t.interval < t.late_after < ttl


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(st.integers(min_value=0, max_value=3600))
def test_a_keeper_is_cut_off_only_once_silent_for_longer_than_a_working_one_ever_is(
    ttl: int,
) -> None:
    t = keep_alive_timing(max(ttl, 1))
    # a working keeper answers within an interval plus one request's timeout at most
    assert not keeper_cut_off(t.interval + t.timeout - 1e-9, ttl)
    assert keeper_cut_off(t.late_after + 1e-3, ttl)


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(st.integers(min_value=0, max_value=3600), st.floats(min_value=0, max_value=10))
def test_a_keeper_stuck_since_just_before_a_renewal_is_found_out_before_the_new_lease_lapses(
    ttl: int, silent_at_renewal: float
) -> None:
    """etcd lost our leases and came back before the keeper, stuck since, had been silent
    for half a TTL: it looked fine when the member lease was taken anew. Judged again
    ``keeper_recheck_after`` later it is cut off however short its silence was then,
    and a new keeper has time left to refresh the new lease."""
    later = keeper_recheck_after(ttl)
    assert keeper_cut_off(silent_at_renewal + later, ttl)
    t = keep_alive_timing(max(ttl, 1))
    # a working keeper has answered by then (an interval, plus one request's timeout)
    assert later > t.interval + t.timeout
    # and a new one can still connect and refresh before the new lease runs out
    assert max(ttl, 1) - later >= t.interval + t.timeout - 1e-9


def test_a_refresh_on_time_says_nothing() -> None:
    assert late_refresh_warning(0.21, 1, since_warned=1e9) is None
    assert late_refresh_warning(0.5, 1, since_warned=1e9) is None


def test_a_late_refresh_says_the_agent_was_starved_and_names_the_knob() -> None:
    message = late_refresh_warning(0.8, 1, since_warned=1e9)
    assert message is not None
    assert "0.8s after the previous refresh" in message and "lease TTL 1s" in message
    assert "--rdzv-conf lease_ttl" in message and "spec.rdzvConf.lease_ttl" in message


def test_late_refreshes_are_reported_at_most_once_a_minute() -> None:
    assert late_refresh_warning(0.8, 1, since_warned=LATE_WARNING_EVERY_S - 1) is None
    assert late_refresh_warning(0.8, 1, since_warned=LATE_WARNING_EVERY_S) is not None


def test_the_granted_ttl_is_logged_with_what_it_means() -> None:
    level, message = granted_ttl_message(1, 1, "etcd:2379")
    assert level == logging.INFO
    assert message.startswith("lease TTL 1s: a node that dies or freezes is noticed within 1-1.5s")


def test_an_etcd_that_raises_the_ttl_is_named_with_how_to_allow_it_or_accept_it() -> None:
    level, message = granted_ttl_message(1, 2, "etcd.etcd-system.svc:2379")
    assert level == logging.WARNING
    assert "asked etcd at etcd.etcd-system.svc:2379 for a 1s lease" in message
    assert "it granted 2s" in message and "within 2-2.5s" in message
    assert "--election-timeout=600" in message and "lease_ttl=2" in message
    assert "\n" not in message


def test_the_runs_lease_is_refreshed_every_few_seconds_and_at_once_after_a_lost_member_lease() -> (
    None
):
    assert not job_lease_due(0.2, member_lease_lost=False)
    assert job_lease_due(2.0, member_lease_lost=False)
    assert job_lease_due(0.0, member_lease_lost=True)


def test_a_node_comes_back_after_a_few_lapses_and_leaves_when_they_keep_coming() -> None:
    assert LAPSES_BEFORE_LEAVING == 4
    assert not leaves_after_lapse((100.0,), 100.0)
    assert not leaves_after_lapse((100.0, 104.0), 104.0)  # a network cut: two, then none
    livelock = tuple(100.0 + 1.5 * i for i in range(4))  # the kind livelock: every 1.5 s
    assert leaves_after_lapse(livelock, livelock[-1])
    spread = (100.0, 120.0, 140.0, 100.0 + LAPSE_WINDOW_S)
    assert leaves_after_lapse(spread, spread[-1])
    # an old lapse is forgotten: a node that blips now and then always comes back
    later = (100.0, 120.0, 140.0, 100.0 + LAPSE_WINDOW_S + 1)
    assert not leaves_after_lapse(later, later[-1])


def test_the_line_a_leaving_node_says_names_it_the_count_and_what_to_do() -> None:
    line = lapses_message("10.0.0.1_7_abc", 2, "job-etcd.ns.svc:2379")
    assert "10.0.0.1_7_abc" in line and "2 times" in line and "job-etcd.ns.svc:2379" in line
    assert "lease_ttl" in line
