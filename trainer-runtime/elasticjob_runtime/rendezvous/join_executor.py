"""Carries out the join loop's steps: each a few etcd requests, no decisions.

The decisions are :mod:`elasticjob_runtime.rendezvous.membership`'s; the loop that asks for them is
:mod:`elasticjob_runtime.rendezvous.join`. What a node has done so far (the round it
entered, the round it took over) lives here because it outlasts one join.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from dataclasses import replace

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from elasticjob_runtime.etcd.client import EtcdError, KeyValue
from elasticjob_runtime.rendezvous.lease_holder import LeaseHolder
from elasticjob_runtime.rendezvous.liveness import PROBE_EVERY_S, StragglerProbe
from elasticjob_runtime.rendezvous.membership import (
    FIRST_ROUND,
    Follow,
    Joined,
    Limits,
    Open,
    Rejoin,
    Round,
    Seal,
    Standby,
    Wait,
    decide_lead,
    decide_standby,
    encode_participants,
    joined_by_record,
    short_of_desired,
    takes_over,
)
from elasticjob_runtime.rendezvous.state import RendezvousState

log = logging.getLogger(__name__)


class MarkedLeaving(SignalException):
    """The operator marked this node leaving (a scale-down) while it was joining a round:
    it stops as a SIGTERM would stop it then. A signal's exception, so torch's launcher
    leaves the run open for the others (any other error closes it) and ``elasticjob-run``
    exits 143, as the departing node it is."""

    def __init__(self, node: str) -> None:
        super().__init__(
            f"{node} was marked leaving (a scale-down) while it joined a round", signal.SIGTERM
        )


class JoinExecutor:
    """One node's hands in the join: open, enter, follow, lead, stand by."""

    def __init__(
        self,
        state: RendezvousState,
        leases: LeaseHolder,
        node: str,
        limits: Limits,
        join_timeout: float,
    ) -> None:
        self.state = state
        self.leases = leases
        self.node = node
        self.limits = limits
        self.join_timeout = join_timeout
        self.entered: int | None = None  # the round whose join key this node put last
        self.leading: int | None = None  # a round this node leads since its leader went
        # Why this node is joining, where it knows better than the rule that opens a
        # round (a lost peer, a departure, a hang: not its own crash); the handler sets it
        # before each join. None: the rule's cause (membership.decide_join).
        self.cause: str | None = None
        # The members this node, leading, waits for, probed for a dead agent (liveness.py).
        self._stragglers = StragglerProbe()

    def time_left(self, deadline: float, why: str) -> float:
        """Seconds to the join deadline; past it, the timeout saying what was missing."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeoutError(
                f"no rendezvous within {self.join_timeout:.0f}s for run "
                f"{self.state.keys.run_id}: {why}"
            )
        return left

    def open(self, step: Open, kv: KeyValue | None) -> None:
        """Open the next round (if no other node just did) and enter it; a node marked
        leaving stops instead (:meth:`stop_if_marked`)."""
        self.stop_if_marked()
        opening = step.round if self.cause is None else replace(step.round, cause=self.cause)
        if self.state.write(opening, kv):
            log.info(
                "etcd-v3: %s: opened round %d (%s): %s",
                self.node,
                opening.number,
                opening.cause,
                step.why,
            )
            self.enter(step.round.number)

    def enter(self, number: int) -> None:
        """Put this node's join key for round ``number``, on its member lease: it vanishes
        with the node, so a leader never waits for a node that died after entering."""
        key = self.state.keys.join(number, self.node)
        self.state.client.put(key, b"", lease=self.leases.member_lease)
        self.entered = number

    def check_sealed(self, number: int) -> tuple[Joined, int] | None:
        """The binding round ``number`` if its sealed record has this node, with the
        revision it was sealed at; either way this node's entry there is spent."""
        self.entered = None
        found = self.state.sealed_record(number)
        joined = None if found is None else joined_by_record(number, found[0], self.node)
        if found is None or joined is None:
            return None
        log.info("etcd-v3: %s: round %d, sealed with it, is binding", self.node, number)
        return joined, found[1]

    def stand_by(self, step: Standby, kv: KeyValue | None, deadline: float) -> float:
        """A node beyond ``max``: open a round once a seat frees up, else wait for a change
        with no join deadline (the one returned starts afresh)."""
        live_at, live = self.state.live()
        match decide_standby(step.round, self.node, live):
            case Open() as opening:
                self.open(opening, kv)
                return deadline
            case Wait():
                deadline = time.monotonic() + self.join_timeout
                self.state.client.wait_for_change(
                    self.state.keys.prefix, live_at, self.join_timeout
                )
                return deadline

    def follow(self, step: Follow, revision: int, deadline: float) -> None:
        """Wait for the leader to seal the round; on a quiet spell, check that the leader
        and this node's own join key are still there (a lease can run out)."""
        left = self.time_left(deadline, f"round {step.number} was not sealed by {step.leader}")
        recheck = max(self.leases.granted_ttl, 1) + 1.0 + random.uniform(0, 0.5)
        if self.state.client.wait_for_change(self.state.keys.state, revision, min(left, recheck)):
            return
        if not self.state.has_entered(step.number, self.node):
            self.entered = None  # its lease ran out and was taken again: enter again
        if self.state.is_live(step.leader):
            return
        _, live = self.state.live()
        _, joins = self.state.joins(step.number)
        if takes_over(self.node, step.leader, joins, live):
            log.info(
                "etcd-v3: %s: leader %s of round %d is gone; leading it",
                self.node,
                step.leader,
                step.number,
            )
            self.leading = step.number

    def lead(
        self, current: Round, kv: KeyValue, last_call: float | None, deadline: float
    ) -> float | None:
        """Seal the forming round once :func:`decide_lead` says so, else wait for a join,
        a lost node or the last call. Returns the last-call deadline to keep."""
        live_at, live = self.state.live()
        joins_at, joins = self.state.joins(current.number)
        first = current.number == FIRST_ROUND
        match decide_lead(self.node, joins, live, self.limits, last_call, time.time(), first):
            case Rejoin():
                # not live: its lease ran out, or it is marked leaving (a new lease would
                # drop the mark with the old one)
                self.stop_if_marked()
                # a new member lease (and keeper, if it stopped answering), and enter again
                why = f"its member lease ran out while it led round {current.number}"
                self.leases.renew_member(why)
                self.entered = None
                return last_call
            case Seal(participants):
                if self._seal(current, kv, participants):
                    short = short_of_desired(self.limits, first, len(participants))
                    if short is not None:
                        log.warning("etcd-v3: %s: %s", self.node, short)
                return None
            case Wait(until=until, why=why):
                left = self.time_left(deadline, why)
                if until is not None:
                    left = min(left, max(until - time.time(), 0.0) + 0.05)
                if self._drop_dead_agents(set(live) - set(joins), live):
                    return last_call  # a lease revoked: read the live set again
                if self._stragglers.probing:
                    left = min(left, PROBE_EVERY_S)  # probe the awaited members again then
                keys = self.state.keys
                watched = [keys.state, keys.members, keys.leaving, keys.joins(current.number)]
                self.state.client.wait_for_change(watched, min(live_at, joins_at), left)
                return until

    def _drop_dead_agents(self, awaited: set[str], live: frozenset[str]) -> bool:
        """Probe the live members this leader still waits for (liveness.py) and revoke
        the member lease of each whose agent refused the connection: it died, and its
        lease would keep the round waiting up to a TTL and a half. Whether one was."""
        dead = self._stragglers.dead(awaited, live, self.state.members)
        for node, lease in dead.items():
            log.info(
                "etcd-v3: %s: the agent of %s is gone (its liveness port refused a "
                "connection); revoking its member lease instead of waiting out its TTL",
                self.node,
                node,
            )
            try:
                self.state.client.revoke(lease)
            except EtcdError as exc:  # gone already, or not ours to revoke: its TTL decides
                log.info("etcd-v3: %s: could not revoke %s's lease: %s", self.node, node, exc)
        return bool(dead)

    def stop_if_marked(self) -> None:
        """:class:`MarkedLeaving` if this node's leaving key is there (one key). Asked only
        where a marked node would do harm: opening a round (the others, sealed without it,
        would regroup for nothing) and taking a new lease as a leader that is not live."""
        if self.state.is_leaving(self.node):
            log.info("etcd-v3: %s: marked leaving while it joins; it stops", self.node)
            raise MarkedLeaving(self.node)

    def _seal(self, current: Round, kv: KeyValue, participants: tuple[str, ...]) -> bool:
        """The round key and the sealed record, in one transaction; whether it won."""
        sealed = Round(
            current.number, participants, True, leader=current.leader, cause=current.cause
        )
        record = {self.state.keys.sealed(current.number): encode_participants(participants)}
        if not self.state.write(sealed, kv, also=record):
            return False
        log.info(
            "etcd-v3: %s: sealed round %d with %d nodes",
            self.node,
            current.number,
            len(participants),
        )
        return True
