"""The departure rule: what a node told to stop (SIGTERM) does so that its peers lose no step.

A pod is stopped with SIGTERM and, a grace period later, SIGKILL: a scale-down, a
``kubectl drain``, a scheduler's preemption, a Kueue eviction, a node being removed. If the
leaving node's agent simply stopped its workers, its peers would learn of it when its
sockets closed: the step in flight everywhere is dropped, and the peers wait for a lease
or a reset to regroup. Instead the leaving node *announces* its departure and *hands its
place over*:

1. :class:`Announce`: it puts ``rdzv/leaving/<node>`` (on its member lease). Its peers'
   round watch sees the key at once and they form the next round without it, as for a
   join: their workers switch at a step boundary, nothing is abandoned. The leaving
   node's workers keep training in the old round meanwhile, so every step they are in
   completes.
2. :class:`AwaitSeal` until a round newer than the node's own is sealed without it.
3. :class:`HandOver`: its workers leave as soon as the old round's group breaks (the
   peers left it at their boundary), without saving: the peers hold the same state.
4. :class:`Gone` once they have exited: the agent exits 143, never 0, so the operator
   never reads a departure as the job's success.

Where handing over cannot work the node stops as torch's agent would (:class:`StopHere`:
its workers save the last completed step and exit): workers that cannot regroup in place
(an unchanged script restarts from a checkpoint anyway), a run that is closed or
stopping as a whole, too few nodes left to form a round, or peers that formed none in
time. Pure: the agent (:mod:`elasticjob_runtime.launch.departing`) reads and acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from elasticjob_runtime.rendezvous.membership import Round, gone_on_without

# How long a leaving node waits for its peers' next round before it stops as before: well
# inside Kubernetes' default 30 s grace, leaving the save time to spare.
SEAL_TIMEOUT_S: Final = 10.0
# How long handed-over workers may take to see their old group break and exit.
EXIT_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True)
class Announce:
    """Put this node's leaving key; its peers form the next round without it."""


@dataclass(frozen=True)
class AwaitSeal:
    """The peers' next round is not sealed yet: keep training in the old one."""


@dataclass(frozen=True)
class HandOver:
    """Round ``number`` was sealed without this node: tell its workers to leave at the
    step boundary their old round votes for."""

    number: int


@dataclass(frozen=True)
class Gone:
    """The workers have left: the agent exits (143)."""


@dataclass(frozen=True)
class StopHere:
    """Stop as without an announcement: the workers save their last step and exit."""

    why: str


Departure = Announce | AwaitSeal | HandOver | Gone | StopHere


@dataclass(frozen=True)
class Standing:
    """Where a node stands in the rendezvous, read now (the handler's part of a view)."""

    me: str
    my_round: int
    participants: tuple[str, ...]  # of my_round, in rank order
    current: Round | None  # the round key now
    others_live: int  # live nodes other than this one (present and not leaving)
    min_nodes: int


@dataclass(frozen=True)
class DepartureView:
    """What a leaving node knows when it decides: the rendezvous, and its workers."""

    standing: Standing
    in_place: bool  # every local worker can regroup in place
    announced: bool
    handed_over: bool
    workers_exited: bool
    waited: float  # seconds since the SIGTERM
    since_handover: float  # seconds since HandOver (0 before)


def successor_round(s: Standing) -> int:
    """The round the other participants went on to without this node (0: none yet)."""
    if s.current is None or not gone_on_without(s.current, s.me, s.my_round, s.participants):
        return 0
    return s.current.number


def decide_departure(v: DepartureView) -> Departure:
    """The next thing a node that was told to stop does (the module docstring says why)."""
    s = v.standing
    if v.handed_over:
        if v.workers_exited:
            return Gone()
        if v.since_handover > EXIT_TIMEOUT_S:
            return StopHere(f"its workers did not leave within {EXIT_TIMEOUT_S:.0f} s")
        return AwaitSeal()
    if v.workers_exited:
        return StopHere("its workers have exited")
    if not v.in_place:
        return StopHere("the workers cannot regroup in place (they resume from a checkpoint)")
    number = successor_round(s) if v.announced else 0
    if number:
        return HandOver(number)
    if s.current is None or s.current.closed:
        return StopHere("the run is closed")
    if len(s.participants) < 2:
        return StopHere("this node is its round's only one")
    if s.others_live < s.min_nodes:
        return StopHere(f"{s.others_live} other node(s) live, fewer than the {s.min_nodes} needed")
    if not v.announced:
        return Announce()
    if v.waited > SEAL_TIMEOUT_S:
        return StopHere(f"the others sealed no round without this node in {SEAL_TIMEOUT_S:.0f} s")
    return AwaitSeal()
