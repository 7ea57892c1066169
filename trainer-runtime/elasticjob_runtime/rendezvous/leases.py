"""How a member lease is kept alive, and what to tell the user about its TTL: pure rules.

A node that dies or freezes is noticed when its member lease runs out, so the lease TTL
is the detection time. What bounds it, from etcd's own source (3.5 and 3.6 alike):

* etcd grants no TTL below ``ceil(1.5 x election timeout)`` (``minTTL`` in
  ``server/etcdserver/server.go``; a shorter request is silently raised,
  ``server/lease/lessor.go`` ``Grant``). With etcd's default 1000 ms that is 2 s; the
  etcds we start run with :data:`~elasticjob_runtime.contract.ETCD_FAST_LEASE_FLAGS`,
  which allow 1 s.
* etcd looks for expired leases every 500 ms (the ticker in ``lessor.runLoop``, not
  configurable), so a key outlives its lease by up to :data:`ETCD_EXPIRY_CHECK_S`.

A short TTL costs keep-alive traffic and risks false alarms: an agent (or an etcd)
starved of CPU for longer than the TTL looks dead to its peers. The keeper refreshes
five times per TTL with a per-request timeout of a quarter of it, so one refresh stuck
on a slow etcd leaves time for the next.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

# The member lease's TTL unless --rdzv-conf lease_ttl says otherwise (etcd counts whole
# seconds, so this is the shortest there is).
DEFAULT_LEASE_TTL: Final = 1
# etcd's lessor checks for expired leases this often (server/lease/lessor.go, runLoop).
ETCD_EXPIRY_CHECK_S: Final = 0.5
# The run's lease (job_ttl, an hour) needs no more than an occasional refresh; it is
# checked at once whenever the member lease turns out to be gone (etcd lost its data?).
JOB_LEASE_REFRESH_S: Final = 2.0
# A join or a registration whose etcd request failed tries again after this long.
RETRY_AFTER_S: Final = 0.5
# A starved keeper is reported at most this often.
LATE_WARNING_EVERY_S: Final = 60.0


@dataclass(frozen=True)
class KeepAliveTiming:
    interval: float  # between two refreshes of the member lease
    timeout: float  # for one refresh request
    late_after: float  # a longer gap between two refreshes means this process was starved


def keep_alive_timing(ttl: int) -> KeepAliveTiming:
    """Refresh five times per TTL and give each request a quarter of it: after a refresh
    stuck on a slow etcd (or a dead connection), the next one is done before the lease
    runs out (2 x (1/5 + 1/4) < 1)."""
    return KeepAliveTiming(interval=ttl / 5, timeout=ttl / 4, late_after=ttl / 2)


def notice_within(ttl: int) -> float:
    """The longest a dead or frozen node's member key outlives it (before the revoke is
    committed and watchers are told, a few ms on a healthy etcd)."""
    return ttl + ETCD_EXPIRY_CHECK_S


def job_lease_due(since_refresh: float, member_lease_lost: bool) -> bool:
    """Refresh the run's lease now? Every few seconds, and at once after the member lease
    was found gone: the same etcd may have lost the run's lease too."""
    return member_lease_lost or since_refresh >= JOB_LEASE_REFRESH_S


def keeper_cut_off(silent_for: float, ttl: int) -> bool:
    """Is a keeper that has had no answer from etcd (a refresh that worked or that etcd
    refused) for ``silent_for`` seconds cut off, when etcd answers the node's other
    connection? It asks five times per TTL and each request times out in a quarter of
    it, so a working one is never silent for half a TTL (``ttl`` 0: not granted yet)."""
    return silent_for > keep_alive_timing(max(ttl, 1)).late_after


def keeper_recheck_after(ttl: int) -> float:
    """When to judge the keeper (:func:`keeper_cut_off`) again after the member lease was
    found gone and taken anew while the keeper still looked fine: it may have answered
    just before etcd lost our leases (a new etcd that came up within half a TTL) and be
    stuck since. By then a working keeper has answered (an interval plus one request's
    timeout), and a new one still has as long to refresh the new lease before it runs
    out (and etcd's expiry check, :data:`ETCD_EXPIRY_CHECK_S`, besides)."""
    t = keep_alive_timing(max(ttl, 1))
    return t.late_after + t.interval / 4


def late_refresh_warning(gap: float, ttl: int, since_warned: float) -> str | None:
    """What to say when two refreshes of the member lease were ``gap`` seconds apart
    (None: nothing, it was on time or we said it less than a minute ago)."""
    if gap <= keep_alive_timing(ttl).late_after or since_warned < LATE_WARNING_EVERY_S:
        return None
    return (
        f"the member lease was refreshed {gap:.1f}s after the previous refresh (lease TTL "
        f"{ttl}s): this agent or etcd did not get the CPU in time (an overloaded node?); "
        f"at {ttl}s its peers drop this node and restart their round. If this recurs, raise "
        "--rdzv-conf lease_ttl (spec.rdzvConf.lease_ttl on an ElasticJob)"
    )


def granted_ttl_message(requested: int, granted: int, where: str) -> tuple[int, str]:
    """The log level and line that tell the user which lease TTL etcd granted and what it
    means for detecting a lost node."""
    notice = f"{granted}-{notice_within(granted):g}s"
    if granted <= requested:
        return logging.INFO, (
            f"lease TTL {granted}s: a node that dies or freezes is noticed within {notice} "
            "(--rdzv-conf lease_ttl)"
        )
    return logging.WARNING, (
        f"asked etcd at {where} for a {requested}s lease (--rdzv-conf lease_ttl={requested}) "
        f"and it granted {granted}s, its minimum (1.5 x its --election-timeout, rounded up "
        f"to whole seconds): a node that dies or freezes is noticed only within {notice}. "
        "Run that etcd with --heartbeat-interval=100 --election-timeout=600 for 1s leases, "
        f"or set lease_ttl={granted} to say that {granted}s is intended"
    )


# A node whose member lease lapses this many times within LAPSE_WINDOW_S leaves the job
# instead of announcing itself once more: every lapse makes each peer regroup, so a node
# that cannot hold its lease would otherwise regroup the whole job for ever (issue 34).
LAPSES_BEFORE_LEAVING: Final = 4
LAPSE_WINDOW_S: Final = 60.0


def leaves_after_lapse(lapsed_at: tuple[float, ...], now: float) -> bool:
    """Does a node whose member lease lapsed at each of ``lapsed_at`` (this lapse, at
    ``now``, included) leave the job rather than announce itself again? A lapse (a starved
    process, a network blip, an etcd that lost its data) costs one regroup and the node
    comes back; after a 10 s network cut on the devcluster a node lapsed twice within 4 s
    while its connections came back, and came back for good. Four within a minute mean
    it cannot hold its lease where it runs (the kind livelock lapsed every 1.5 s), and
    its peers train better without it than regrouping with it."""
    recent = [t for t in lapsed_at if now - t <= LAPSE_WINDOW_S]
    return len(recent) >= LAPSES_BEFORE_LEAVING


def lapses_message(node: str, lapses: int, where: str) -> str:
    """The one line a node that leaves for lapsed leases says (:func:`leaves_after_lapse`)."""
    return (
        f"node {node} lost its member lease {lapses} times within {LAPSE_WINDOW_S:g} s "
        f"although it reached etcd at {where} in between: its peers regroup each time, so it "
        "leaves the job rather than announce itself again. Its pod's connections to etcd "
        "are unreliable or its CPU is starved; the job goes on without it (its pod is "
        "replaced), or raise --rdzv-conf lease_ttl (spec.rdzvConf.lease_ttl) if the node is "
        "only slow"
    )
