"""Pure rendezvous decisions: given a round and the live nodes, what does a node do next.

No I/O here, so every rule is tested directly (tests/unit). The etcd-v3 handler
(:mod:`elasticjob_runtime.rendezvous`) reads the round and the live set in one
snapshot, calls these functions, and writes the result back with a
compare-and-set, retrying from the new snapshot when another node won.

A node is *live* while its etcd lease holds its member key; that is how a round
learns of a lost peer within the lease TTL instead of heartbeat timeouts, and why
a round can close as soon as every live node has joined (no last call to sit out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Round:
    """One rendezvous round: who is in it, in rank order, and whether it is sealed."""

    number: int
    participants: tuple[str, ...] = ()
    complete: bool = False
    closed: bool = False
    last_call: float | None = None  # wall-clock deadline once min nodes have joined

    def encode(self) -> bytes:
        return json.dumps(
            {
                "number": self.number,
                "participants": list(self.participants),
                "complete": self.complete,
                "closed": self.closed,
                "last_call": self.last_call,
            },
            sort_keys=True,
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> Round:
        data = json.loads(raw)
        return Round(
            number=int(data["number"]),
            participants=tuple(str(p) for p in data["participants"]),
            complete=bool(data["complete"]),
            closed=bool(data["closed"]),
            last_call=None if data.get("last_call") is None else float(data["last_call"]),
        )


@dataclass(frozen=True)
class Limits:
    min_nodes: int
    max_nodes: int
    last_call: float  # seconds to wait for live nodes that have not joined yet


@dataclass(frozen=True)
class Joined:
    """``me`` is in sealed round ``number``; it still has to confirm it (see :func:`confirm`)."""

    number: int
    participants: tuple[str, ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.participants)


@dataclass(frozen=True)
class Write:
    """Compare-and-set the round to this value, then decide again."""

    round: Round
    why: str


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the round or the live set changes (or ``until``, wall clock)."""

    until: float | None
    why: str
    standby: bool = False  # a spare beyond max nodes: waits for a free seat, not a deadline


@dataclass(frozen=True)
class Closed:
    pass


Decision = Joined | Write | Wait | Closed


def lost_participants(participants: tuple[str, ...], live: frozenset[str]) -> list[str]:
    """The participants whose member lease is gone, in rank order."""
    return [p for p in participants if p not in live]


def decide_join(
    current: Round | None,
    live: frozenset[str],
    me: str,
    limits: Limits,
    last_joined: int,
    now: float,
) -> Decision:
    """Next step for ``me``, which wants a round newer than ``last_joined``."""
    if current is None:
        return Write(Round(number=last_joined + 1, participants=(me,)), "first node opens a round")
    if current.closed:
        return Closed()
    if current.complete:
        if me in current.participants and current.number > last_joined:
            return Joined(current.number, current.participants, current.participants.index(me))
        lost = lost_participants(current.participants, live)
        if me in current.participants or lost or len(current.participants) < limits.max_nodes:
            why = (
                f"lost {', '.join(lost)}"
                if lost
                else "restarting after a local failure"
                if me in current.participants
                else "joining a round with room"
            )
            return Write(Round(number=current.number + 1, participants=(me,)), why)
        return Wait(
            None, f"round {current.number} is full ({limits.max_nodes} nodes); standing by", True
        )
    # The round is still forming: drop members whose lease is gone, then join it.
    members = tuple(p for p in current.participants if p in live)
    if me not in members:
        if len(members) >= limits.max_nodes:
            return Wait(None, f"round {current.number} is full; standing by", True)
        members = (*members, me)
    last_call = current.last_call
    if len(members) < limits.min_nodes:
        last_call = None
    elif last_call is None:
        last_call = now + limits.last_call
    everyone_here = live <= set(members)
    if len(members) >= limits.min_nodes and (
        len(members) >= limits.max_nodes
        or everyone_here
        or (last_call is not None and now >= last_call)
    ):
        sealed = replace(current, participants=members, complete=True, last_call=None)
        return Write(sealed, f"sealing round {current.number} with {len(members)} nodes")
    if members != current.participants or last_call != current.last_call:
        return Write(replace(current, participants=members, last_call=last_call), "joining")
    if len(members) < limits.min_nodes:
        why = f"{len(members)} of at least {limits.min_nodes} nodes have joined"
    else:
        why = "waiting for live nodes that have not joined yet"
    return Wait(last_call, why)


def confirm(
    joined: Joined, current: Round | None, live: frozenset[str], acked: frozenset[str]
) -> str:
    """After joining a round: "ready" once every participant has confirmed it, "wait"
    while some have not, "withdraw" if it was superseded or lost a participant first.

    A participant that read the state only after a newer round opened never takes
    part in the sealed one; without confirmations the others would wait for it in
    the round's store until the store timeout. "ready" holds even once a newer round
    has opened: every participant has committed to this one, so all of them run it
    (and then restart into the newer one). A node withdraws only with a transaction
    that fails if all have confirmed, so no node is left alone in a round its peers
    abandoned.
    """
    if set(joined.participants) <= acked:
        return "ready"
    superseded = current is None or current.number != joined.number or not current.complete
    if superseded or lost_participants(joined.participants, live):
        return "withdraw"
    return "wait"


def restart_reason(current: Round | None, live: frozenset[str], my_round: int) -> str | None:
    """Why a node running round ``my_round`` must restart its workers, or None to keep going."""
    if current is None:
        return "the rendezvous state is gone"
    if current.closed:
        return None
    if current.number != my_round:
        return f"round {current.number} has opened (a node joined or left)"
    lost = lost_participants(current.participants, live)
    if lost:
        return f"lost peer(s) {', '.join(lost)}"
    return None
