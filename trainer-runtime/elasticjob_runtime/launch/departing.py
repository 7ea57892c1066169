"""How an agent told to stop (SIGTERM) leaves without costing its peers a step.

``elasticjob-run`` takes SIGTERM itself (torch's agent would stop the workers at once,
:mod:`elasticjob_runtime.launch.launcher`). While a round trains, the signal only asks
for a departure (:class:`DepartureRequest`); the agent's monitor loop then carries out
:func:`~elasticjob_runtime.rendezvous.departure.decide_departure` each pass
(:class:`Departing`): announce, wait for the others' next round, hand over, exit 143.
At any other moment (a rendezvous under way, the exit barrier) the signal stops the
agent as torch's would.

The operator, removing several pods at once (a scale-down), marks all their nodes
leaving in one etcd transaction before it deletes them, so the others regroup once and
not once per SIGTERM. A node that sees its own mark while a round trains departs exactly
as after a SIGTERM, its announcement made for it (:meth:`Departing.follow_mark`); the
SIGTERM that follows changes nothing.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing import SignalException

from elasticjob_runtime.etcd.client import EtcdError
from elasticjob_runtime.launch.channel import AgentChannel
from elasticjob_runtime.rendezvous.api import MembershipRendezvous
from elasticjob_runtime.rendezvous.departure import (
    Announce,
    AwaitSeal,
    DepartureView,
    Gone,
    HandOver,
    StopHere,
    decide_departure,
)

log = logging.getLogger(__name__)


def stop_signal(sig: signal.Signals = signal.SIGTERM) -> SignalException:
    """What stops torch's agent: its run() stops the workers with ``sig`` and re-raises."""
    return SignalException(f"got {sig.name}", sigval=sig)


class DepartureRequest:
    """The SIGTERM handler's side: a departure asked for, if an agent can carry it out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepting = False  # an agent's round is training: it can hand over
        self.requested_at: float | None = None
        # called once a departure is under way (the agent's monitor pass, at once)
        self.on_taken: Callable[[], None] = lambda: None

    def take(self) -> bool:
        """From the signal handler: True when a departure is (now) under way; False when
        no round trains, and the agent must stop as torch's would."""
        if self.requested_at is not None:
            return True  # a second SIGTERM changes nothing
        if not self.accepting:
            return False
        self.requested_at = time.monotonic()
        self.on_taken()
        return True

    def close(self) -> bool:
        """The round is ending for another reason (a peer left or came): no SIGTERM from
        now on asks for a departure. True when one was taken before, in the moment between
        the monitor pass's look at the request and now: the node joins no further round
        and must stop (a job deleted whole: every pod's SIGTERM lands as its peers
        announce, and a node that regrouped waited for a deleted etcd until SIGKILL)."""
        self.accepting = False
        return self.requested_at is not None


class Departing:
    """The agent's hands for a departure: one :func:`decide_departure` per monitor pass."""

    def __init__(
        self, request: DepartureRequest, membership: MembershipRendezvous, channel: AgentChannel
    ) -> None:
        self.request = request
        self._membership = membership
        self._channel = channel
        self._announced = False
        self._handed_over_at: float | None = None

    @property
    def under_way(self) -> bool:
        return self.request.requested_at is not None

    def follow_mark(self) -> None:
        """Depart if the operator marked this node leaving (its round watch saw the key):
        the request is taken as a SIGTERM's would be, already announced."""
        if self.under_way or not self._membership.is_leaving():
            return
        if self.request.take():
            self._announced = True
            log.info("departure: this node was marked leaving (a scale-down); it hands over")

    def step(self, in_place: Callable[[], bool], workers_exited: bool) -> None:
        """Carry out this pass's decision; raises :class:`SignalException` to stop."""
        assert self.request.requested_at is not None
        now = time.monotonic()
        try:
            standing = self._membership.standing()
        except EtcdError as exc:
            log.warning("departure: cannot read the rendezvous (%s); stopping here", exc)
            raise stop_signal() from exc
        view = DepartureView(
            standing=standing,
            in_place=in_place(),
            announced=self._announced,
            handed_over=self._handed_over_at is not None,
            workers_exited=workers_exited,
            waited=now - self.request.requested_at,
            since_handover=0.0 if self._handed_over_at is None else now - self._handed_over_at,
        )
        match decide_departure(view):
            case Announce():
                self._membership.announce_departure()
                self._announced = True
                log.info("SIGTERM: announced this node's departure; the others regroup without it")
            case HandOver(number=number):
                self._channel.hand_over()
                self._handed_over_at = now
                log.info(
                    "departure: round %d was sealed without this node after %.2f s; its "
                    "workers leave at the step boundary the old round votes for",
                    number,
                    view.waited,
                )
            case Gone():
                log.info("departure: the workers have left; exiting")
                raise stop_signal()
            case StopHere(why=why):
                log.info("SIGTERM: stopping the workers (they save their last step): %s", why)
                raise stop_signal()
            case AwaitSeal():
                pass
