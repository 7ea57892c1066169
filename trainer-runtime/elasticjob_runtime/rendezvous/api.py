"""What the agent needs from a rendezvous beyond torch's ``RendezvousHandler``.

torch's agent needs only ``RendezvousHandler`` (``next_rendezvous``,
``num_nodes_waiting``, ...). Ours asks more of the rendezvous it runs with: who of the
round is gone, why a failure may have been a membership change, where to record a hang
for the operator, and that training finished. The etcd-v3 handler
(:mod:`elasticjob_runtime.rendezvous.handler`) provides it; with any other backend
(``c10d``, ``static``) the agent behaves as torch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from elasticjob_runtime.rendezvous.departure import Standing


@runtime_checkable
class MembershipRendezvous(Protocol):
    """A rendezvous that knows its members' liveness (leases) and keeps run records."""

    node: str  # this agent's name in the rounds
    # why the next round this node opens is opened, where the agent knows (a hang), and
    # the cause of the round it last joined ("": not known); membership.RoundCause
    next_cause: str | None
    round_cause: str

    @property
    def lease_ttl(self) -> int:
        """Seconds a member's lease outlives it: how late its loss can be noticed."""
        ...

    @property
    def round_number(self) -> int:
        """The round this node last joined (0 before the first)."""
        ...

    def get_run_id(self) -> str: ...

    def peers_lost(self) -> list[str]:
        """Members of this node's round that are gone (their lease expired)."""
        ...

    def wait_for_membership_change(self, timeout: float) -> str | None:
        """Why this node must move to a new round, waiting up to ``timeout``; None: no
        change, so a failure was this node's own."""
        ...

    def wake_on_change(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (from another thread) whenever the round watch sees a change:
        the agent's monitor pass then starts at once (launch/monitor_wake.py)."""
        ...

    def put_run_record(self, key: str, value: bytes) -> None:
        """Record something about the run (a hang) for the operator to read."""
        ...

    def mark_finished(self) -> None:
        """This node's training finished: later joiners are told the run is over."""
        ...

    def announce_departure(self) -> None:
        """This node is leaving: its peers form the next round without it, and it joins
        none (rendezvous/departure.py)."""
        ...

    def is_leaving(self) -> bool:
        """This node's leaving key is there: it announced its departure, or the operator
        marked it for a scale-down (then it departs as if told to stop)."""
        ...

    def standing(self) -> Standing:
        """Where this node stands in the rendezvous, read now (EtcdError if etcd fails)."""
        ...


def membership_of(handler: Any) -> MembershipRendezvous | None:
    """``handler`` as a :class:`MembershipRendezvous`, or None for torch's own backends."""
    return handler if isinstance(handler, MembershipRendezvous) else None
