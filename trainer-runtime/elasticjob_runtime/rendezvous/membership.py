"""Pure rendezvous decisions: given a round and what a node knows, what does it do next.

No I/O here, so every rule is tested directly (tests/unit). The etcd-v3 rendezvous reads
(:mod:`elasticjob_runtime.rendezvous.state`), calls these functions (the join loop,
:mod:`elasticjob_runtime.rendezvous.join`, ``match``es on :func:`decide_next`), and
carries the result out (:mod:`elasticjob_runtime.rendezvous.join_executor`).

How a round forms, and why it costs each node O(1) etcd requests:

* One node *opens* round n with a compare-and-set on the round key; it is the round's
  *leader*. Everyone else *enters* by putting a key of its own (``rounds/n/joins/<node>``,
  on its member lease): no compare-and-set, so N nodes never fight over one key.
* Only the leader reads the joins and the live nodes; it *seals* the round (the round
  key and a ``rounds/n/sealed`` record, in one transaction) once every live node has
  entered, or ``max`` have, or the last call has run out with at least ``min``. The
  run's first round also waits, up to the last call, for the nodes the job asked for
  (:func:`awaited`): their agents start together, and one still starting is not live
  yet. The others wait on the round key alone. If the leader's lease goes, the
  earliest live entrant leads instead.
* A sealed round is binding: every participant runs it, even one that reads it only
  after a newer round has opened (it finds itself in the sealed record), and then
  restarts into the newer one. A newer round opens only over a sealed one, so rounds
  never supersede each other while forming: the livelock in which latecomers kept
  re-opening rounds that were still being confirmed cannot happen.

A node is *live* while its etcd lease holds its member key; that is how a round learns
of a lost peer within the lease TTL instead of heartbeat timeouts.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from elasticjob_runtime import contract


class RoundCause(enum.StrEnum):
    """Why a round was opened, as its opener knew it: written in the round key, handed
    to every worker of the round (``contract.ROUND_CAUSE``), so that a survivor, which
    saw only a broken collective or a new round, can say what its pause was for (the
    goodput ledger's causes, docs/goodput.md)."""

    START = "start"  # the run's first round
    CRASH = "crash"  # the opener's own worker exited (a crash; its agent restarted it)
    NODE_LOST = "node-lost"  # a participant's member lease lapsed: a lost or frozen node
    JOIN = "join"  # a node came to a round with room
    DEPARTURE = "departure"  # a participant announced its departure
    HANG = "hang"  # the opener's agent saw its workers' steps stop (hang detection)


@dataclass(frozen=True)
class Round:
    """One rendezvous round: its number, whether it is sealed, and who is in it (in rank
    order, once sealed). ``leader`` opened it and seals it while its lease holds.
    ``finished``: the run was closed by a node whose training finished, not one that
    failed, so a node that comes later has nothing to do rather than an error."""

    number: int
    participants: tuple[str, ...] = ()
    complete: bool = False
    closed: bool = False
    leader: str = ""
    finished: bool = False
    cause: str = ""  # a RoundCause ("" from an older runtime, or not known)

    def encode(self) -> bytes:
        doc: dict[str, object] = {
            "number": self.number,
            "participants": list(self.participants),
            "complete": self.complete,
            "closed": self.closed,
            "leader": self.leader,
            "finished": self.finished,
        }
        if self.cause:
            doc["cause"] = self.cause
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes) -> Round:
        data = json.loads(raw)
        return Round(
            number=int(data["number"]),
            participants=tuple(str(p) for p in data.get("participants", ())),
            complete=bool(data.get("complete", False)),
            closed=bool(data.get("closed", False)),
            leader=str(data.get("leader", "")),
            finished=bool(data.get("finished", False)),
            cause=str(data.get("cause", "")),
        )


def encode_participants(participants: Sequence[str]) -> bytes:
    """The sealed record of a round: who is in it, in rank order."""
    return json.dumps(list(participants)).encode()


def decode_participants(raw: bytes) -> tuple[str, ...]:
    return tuple(str(p) for p in json.loads(raw))


# A run's first round: a node that finds no round opens its last round + 1, and a new
# agent has run none.
FIRST_ROUND: Final = 1


@dataclass(frozen=True)
class Limits:
    min_nodes: int
    max_nodes: int
    last_call: float  # seconds to wait, once ``min`` have entered, for nodes that have not
    # the nodes the job asked for (ELASTICJOB_DESIRED_NODES; None: not said), which the
    # run's first round waits for (:func:`awaited`) up to its own, longer, last call
    desired: int | None = None
    # seconds the run's first round waits for them, from ``min`` entered (at least
    # ``last_call``): a job's pods start tens of seconds apart on a real cluster (on kind,
    # one pod reached etcd 21 s after its peer: its node admitted its traffic late)
    first_round_wait: float = 0.0


def desired_nodes(env: Mapping[str, str]) -> int | None:
    """The nodes the job asked for, from ``ELASTICJOB_DESIRED_NODES`` (the operator sets
    it to the job's replicas); None when unset. ValueError, in one line, otherwise."""
    raw = env.get(contract.DESIRED_NODES, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"{contract.DESIRED_NODES}={raw!r}: must be a whole number of nodes, at least 1 "
            "(how many the job asked for; unset, the first round waits only for live nodes)"
        )
    return int(raw)


def last_call_of(limits: Limits, first_round: bool) -> float:
    """How long a round waits, once ``min`` have entered, for those it awaits: the run's
    first round, when the job said how many it asked for, as long as ``first_round_wait``."""
    if first_round and limits.desired is not None:
        return max(limits.last_call, limits.first_round_wait)
    return limits.last_call


def awaited(limits: Limits, first_round: bool) -> int:
    """How many entrants a round waits for, up to its last call, even once every live
    node has entered. The run's first round: the nodes the job asked for (within
    ``min``..``max``), as a job's agents start together and one whose pod is still
    starting has no member key yet; sealing without it trained a short job at ``min``
    alone. A later round: ``min``, so a regroup after a loss waits for nobody (a node
    that comes later opens the next round itself)."""
    if not first_round or limits.desired is None:
        return limits.min_nodes
    return min(max(limits.desired, limits.min_nodes), limits.max_nodes)


@dataclass(frozen=True)
class Joined:
    """``me`` is rank ``rank`` of sealed round ``number``: start it."""

    number: int
    participants: tuple[str, ...]
    rank: int
    cause: str = ""  # the round's RoundCause ("": not known, e.g. read from its sealed record)

    @property
    def world_size(self) -> int:
        return len(self.participants)


@dataclass(frozen=True)
class Open:
    """Compare-and-set the round key to this new, forming round (led by ``me``)."""

    round: Round
    why: str


@dataclass(frozen=True)
class Enter:
    """Put this node's join key for forming round ``number``."""

    number: int


@dataclass(frozen=True)
class Lead:
    """``me`` leads forming round ``number``: read its joins and the live nodes, then
    :func:`decide_seal`."""

    number: int


@dataclass(frozen=True)
class Follow:
    """Wait for ``leader`` to seal round ``number``; now and then check that it lives."""

    number: int
    leader: str


@dataclass(frozen=True)
class Standby:
    """The sealed round is full and ``me`` is not in it: read the live nodes and
    :func:`decide_standby`."""

    round: Round


@dataclass(frozen=True)
class Seal:
    """Seal the round with these participants, in rank order."""

    participants: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the round or the live set changes (or ``until``, wall clock)."""

    until: float | None
    why: str
    standby: bool = False  # a spare beyond max nodes: waits for a free seat, not a deadline


@dataclass(frozen=True)
class Closed:
    """The run admits nobody any more; ``finished``: because its training finished."""

    finished: bool = False


@dataclass(frozen=True)
class CheckSealed:
    """The round ``me`` entered (``number``) was sealed and a newer one opened before
    ``me`` read it: read the round's sealed record and :func:`joined_by_record`."""

    number: int


@dataclass(frozen=True)
class Rejoin:
    """``me``'s own member lease ran out while it led: take a new one, enter again."""


Decision = Joined | Open | Enter | Lead | Follow | Standby | Closed
# What the join loop acts on: a decision, or first the binding-sealed-round check.
Step = Decision | CheckSealed


def lost_participants(participants: Sequence[str], live: frozenset[str]) -> list[str]:
    """The participants whose member lease is gone, in rank order."""
    return [p for p in participants if p not in live]


def gone_on_without(
    current: Round | None, me: str, my_round: int, participants: Sequence[str]
) -> list[str]:
    """The participants of ``me``'s round ``my_round`` that went on to a newer round
    without ``me`` (it was cut off long enough to lose its lease): they have left the
    round's group, and a collective of it may never fail by itself (their sockets' last
    words can be lost with the cut), so its workers must abandon it."""
    if current is None or current.closed or current.number <= my_round:
        return []
    if current.complete:
        if me in current.participants:
            return []
        return [p for p in participants if p != me and p in current.participants]
    if current.number > my_round + 1:
        # a round after ours was sealed before this one opened, and not with this node
        return [p for p in participants if p != me]
    return []


def decide_join(
    current: Round | None, me: str, limits: Limits, last_joined: int, entered: int | None
) -> Decision:
    """Next step for ``me``, which wants a round newer than ``last_joined`` and has put
    its join key for round ``entered`` (None: for none yet).

    Reads only the round key: the live nodes matter only to a leader and to a node
    standing by, which read them themselves.
    """
    if current is None:
        first = Round(number=last_joined + 1, leader=me, cause=RoundCause.START)
        return Open(first, "first node opens a round")
    if current.closed:
        return Closed(current.finished)
    if current.complete:
        if me in current.participants and current.number > last_joined:
            index = current.participants.index(me)
            return Joined(current.number, current.participants, index, current.cause)
        nxt = Round(number=current.number + 1, leader=me)
        if me in current.participants:  # (its agent may know better: JoinExecutor.cause)
            return Open(replace(nxt, cause=RoundCause.CRASH), "restarting after a local failure")
        if len(current.participants) < limits.max_nodes:
            return Open(replace(nxt, cause=RoundCause.JOIN), "joining a round with room")
        return Standby(current)
    if entered != current.number:
        return Enter(current.number)
    if current.leader == me:
        return Lead(current.number)
    return Follow(current.number, current.leader)


def binding_round(current: Round | None, entered: int | None, last_joined: int) -> int | None:
    """The round whose sealed record ``me`` must read before anything else, or None.

    A sealed round is binding: if the round ``me`` entered (newer than the last it ran) is
    behind the round key, it was sealed (a newer round opens only over a sealed one) and
    ``me`` may be in it, with peers waiting for it there.
    """
    if entered is None or current is None:
        return None
    return entered if current.number > entered > last_joined else None


def joined_by_record(number: int, participants: Sequence[str], me: str) -> Joined | None:
    """``me``'s place in round ``number`` as its sealed record has it; None: not in it."""
    if me not in participants:
        return None
    return Joined(number, tuple(participants), list(participants).index(me))


def decide_next(
    current: Round | None,
    me: str,
    limits: Limits,
    last_joined: int,
    entered: int | None,
    leading: int | None,
) -> Step:
    """The join loop's rule: :func:`binding_round` first, then :func:`decide_join`, with
    a round that ``me`` took over (``leading``, see :func:`takes_over`) led by ``me``
    although the round key still names its gone opener."""
    binding = binding_round(current, entered, last_joined)
    if binding is not None:
        return CheckSealed(binding)
    decision = decide_join(current, me, limits, last_joined, entered)
    match decision:
        case Follow(number=number) if number == leading:
            return Lead(number)
        case _:
            return decision


def takes_over(me: str, leader: str, joins: Sequence[str], live: frozenset[str]) -> bool:
    """A follower's rule on a quiet spell: ``me`` leads the round from now on when its
    leader's lease is gone and ``me`` is the earliest live entrant (:func:`leader_of`)."""
    return leader not in live and leader_of(leader, joins, live) == me


def decide_lead(
    me: str,
    joins: Sequence[str],
    live: frozenset[str],
    limits: Limits,
    deadline: float | None,
    now: float,
    first_round: bool = False,
) -> Seal | Wait | Rejoin:
    """The leader's step: :func:`decide_seal`, unless its own lease ran out; its join key
    went with it, so it must take a new lease and enter again before it can seal."""
    if me not in live:
        return Rejoin()
    return decide_seal(joins, live, limits, deadline, now, first_round)


def decide_standby(current: Round, me: str, live: frozenset[str]) -> Open | Wait:
    """A node beyond ``max``: open the next round once a participant is lost, else wait."""
    lost = lost_participants(current.participants, live)
    if lost:
        nxt = Round(number=current.number + 1, leader=me, cause=RoundCause.NODE_LOST)
        return Open(nxt, f"lost {', '.join(lost)}")
    return Wait(
        None,
        f"round {current.number} is full ({len(current.participants)} nodes); standing by",
        standby=True,
    )


def leader_of(opener: str, joins: Sequence[str], live: frozenset[str]) -> str | None:
    """Who seals a forming round: its opener while live, else the earliest live entrant."""
    if opener in live:
        return opener
    return next((j for j in joins if j in live), None)


def decide_seal(
    joins: Sequence[str],
    live: frozenset[str],
    limits: Limits,
    deadline: float | None,
    now: float,
    first_round: bool = False,
) -> Seal | Wait:
    """The leader's rule. ``joins`` in the order they were put; ``deadline``: the last
    call, as the previous :class:`Wait` set it (None until ``min`` nodes were in).

    Seal once ``min`` live nodes have entered and either every live node has (and, in
    the run's first round, the nodes the job asked for: :func:`awaited`), or ``max``
    have, or the last call ran out; never below ``min``.
    """
    members = [j for j in dict.fromkeys(joins) if j in live]
    if len(members) < limits.min_nodes:
        return Wait(None, f"{len(members)} of at least {limits.min_nodes} nodes have joined")
    if deadline is None:
        deadline = now + last_call_of(limits, first_round)
    everyone_here = live <= set(members)
    wanted = awaited(limits, first_round)
    if (
        len(members) >= limits.max_nodes
        or (everyone_here and len(members) >= wanted)
        or now >= deadline
    ):
        return Seal(tuple(members[: limits.max_nodes]))
    if everyone_here:
        return Wait(deadline, f"{len(members)} of the {wanted} nodes the job asked for have joined")
    return Wait(deadline, "waiting for live nodes that have not joined yet")


def short_of_desired(limits: Limits, first_round: bool, sealed: int) -> str | None:
    """What the leader says when its last call ran out before the nodes the job asked
    for came (the run trains with fewer until they do), or None."""
    wanted = awaited(limits, first_round)
    if sealed >= wanted:
        return None
    return (
        f"sealed the first round with {sealed} of the {wanted} nodes the job asked for: "
        f"the others had not joined {last_call_of(limits, first_round):g}s after the first "
        f"{limits.min_nodes}; they join the next round when they come (raise --rdzv-conf "
        "first_round_timeout if your nodes start further apart)"
    )


def restart_cause(
    current: Round | None, lost: Sequence[str], my_round: int, leaving: Sequence[str] = ()
) -> RoundCause | None:
    """The cause a node that must restart its workers (:func:`restart_reason`) writes in
    the round it opens for it; None where the round it will join is another's (a newer
    round has opened, the state is gone) or there is no restart."""
    if current is None or current.closed or current.number != my_round:
        return None
    if lost:
        return RoundCause.NODE_LOST
    if leaving:
        return RoundCause.DEPARTURE
    return None


def restart_reason(
    current: Round | None, lost: Sequence[str], my_round: int, leaving: Sequence[str] = ()
) -> str | None:
    """Why a node running round ``my_round`` must restart its workers, or None to keep
    going. ``lost``: its round's participants whose member lease is gone; ``leaving``:
    those that announced their departure (their workers finish the step in flight)."""
    if current is None:
        return "the rendezvous state is gone"
    if current.closed:
        return None
    if current.number != my_round:
        return f"round {current.number} has opened (a node joined or left)"
    if lost:
        return f"lost peer(s) {', '.join(lost)}"
    if leaving:
        return f"{', '.join(leaving)} announced its departure"
    return None
