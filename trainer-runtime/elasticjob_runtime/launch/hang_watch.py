"""The agent's hang watch: its clock over the workers' steps, the round last handed to
them in place, and the record of a hang for the operator.

The rules are :mod:`elasticjob_runtime.launch.hang`'s (pure); this holds what they need between
calls (the clock keeps the last group step it saw), reads what only it needs (the rounds
taken, ``/proc``) and does the one write (the hang record in the run's etcd).
:class:`~elasticjob_runtime.launch.agent.MembershipAwareAgent` asks it whether its workers hung,
and whether they can be handed a round in place.

It reads no step files: the agent reads them once per monitor pass and hands the same
steps, and the time it read them, to every reader of that pass (this watch and the spare
refill), so the clock runs on what the agent saw, not on a second read moments later.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdError
from elasticjob_runtime.etcd.records import Hang, encode_hang
from elasticjob_runtime.launch.channel import AgentChannel
from elasticjob_runtime.launch.hang import (
    InPlaceRound,
    StepClock,
    group_step,
    hang_message,
    in_place_refusal,
    round_in_place,
    unresponsive,
)
from elasticjob_runtime.launch.process_state import stopped_ranks
from elasticjob_runtime.rendezvous.api import MembershipRendezvous

log = logging.getLogger(__name__)


@dataclass
class HangWatch:
    """See the module docstring. ``timeout`` None: hangs are not judged (the in-place
    refusal still applies to stopped workers and to those that asked for a round)."""

    channel: AgentChannel
    timeout: float | None
    membership: MembershipRendezvous | None
    hangs: int = 0  # hangs judged so far
    clock: StepClock = field(default_factory=StepClock)
    in_place: InPlaceRound | None = None  # the last round handed to the workers in place

    @property
    def watching(self) -> bool:
        """Whether hangs are judged: only then does the agent read steps for this watch."""
        return self.timeout is not None

    def round_started(
        self,
        generation: int,
        ranks: Iterable[int],
        in_place: bool,
        steps: Mapping[int, int],
        now: float,
    ) -> None:
        """A round reached the workers at ``now``, when they had reported ``steps``:
        started ones took it; running ones must still. Its clock runs from its first step
        (workers regrouping in place have reported steps already; only a change counts)."""
        taken = self.channel.taken()
        self.in_place = (
            round_in_place(self.in_place, generation, now, taken, ranks) if in_place else None
        )
        self.clock = StepClock.start(group_step(steps))

    def in_place_refusal(
        self, pids: Mapping[int, int], generation: int, steps: Mapping[int, int], now: float
    ) -> str | None:
        """Why the running workers cannot take the next round in place, or None (``steps``:
        what they reported, read at ``now``)."""
        self.clock = self.clock.observe(group_step(steps), now)
        untaken = self._untaken(pids)
        return in_place_refusal(
            silent_for=unresponsive(self.clock, now, self.in_place, untaken),
            timeout=self.timeout,
            stopped=stopped_ranks(pids),
            asked=[r for r, g in self.channel.regroup_requests().items() if g >= generation],
            ranks=pids,
        )

    def hang(self, pids: Mapping[int, int], steps: Mapping[int, int], now: float) -> str | None:
        """The message of a hang when the workers did no step (nor took their round) for
        the timeout, recorded for the operator; else None. ``steps``: what they reported,
        read at ``now``; the agent calls this each time it reads them (how often decides
        how late a hang is seen)."""
        if self.timeout is None:
            return None
        self.clock = self.clock.observe(group_step(steps), now)
        untaken = self._untaken(pids)
        stalled = unresponsive(self.clock, now, self.in_place, untaken)
        if stalled < self.timeout:
            return None
        step = self.clock.last or 0
        self.hangs += 1
        message = hang_message(step, stalled, self.timeout, untaken)
        log.warning("hang %d: %s", self.hangs, message)
        self._record(Hang(0, "", step, stalled, self.timeout, 0.0))
        self.clock = StepClock()
        return message

    def _untaken(self, ranks: Iterable[int]) -> list[int]:
        """The local ranks that have not taken the round last handed to them in place."""
        if self.in_place is None:
            return []
        return self.in_place.untaken(self.channel.taken(), ranks)

    def _record(self, hang: Hang) -> None:
        """Tell the operator, through the run's etcd: one key per round, so agents that
        all noticed the same hang record it once. Failing to is logged, not fatal."""
        membership = self.membership
        if membership is None:
            return
        pod = os.environ.get(contract.POD_NAME) or membership.node
        record = replace(hang, round=membership.round_number, pod=pod, updated=time.time())
        try:
            membership.put_run_record(
                contract.hang_key(membership.get_run_id(), record.round), encode_hang(record)
            )
        except EtcdError as exc:
            log.warning("hang not recorded for the operator: %s", exc)
