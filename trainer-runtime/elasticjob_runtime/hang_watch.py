"""The agent's hang watch: its clock over the workers' steps, the round last handed to
them in place, and the record of a hang for the operator.

The rules are :mod:`elasticjob_runtime.hang`'s (pure); this holds what they need between
calls and does the reading (the channel's step files, ``/proc``) and the one write (the
hang record in the run's etcd). :class:`~elasticjob_runtime.agent.MembershipAwareAgent`
asks it whether its workers hung, and whether they can be handed a round in place.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from elasticjob_runtime import contract
from elasticjob_runtime.channel import AgentChannel
from elasticjob_runtime.etcd_client import EtcdError
from elasticjob_runtime.hang import (
    InPlaceRound,
    StepClock,
    group_step,
    hang_message,
    in_place_refusal,
    round_in_place,
    stopped_ranks,
    unresponsive,
)
from elasticjob_runtime.records import Hang, encode_hang
from elasticjob_runtime.rendezvous_api import MembershipRendezvous

log = logging.getLogger(__name__)

# How often the agent reads its workers' steps (torch's loop asks every 0.1 s).
STEP_READ_INTERVAL_S = 0.5


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
    _read_at: float = -1.0

    def round_started(self, generation: int, ranks: Iterable[int], in_place: bool) -> None:
        """A round reached the workers: started ones took it; running ones must still.
        Its clock runs from its first step (workers regrouping in place have reported
        steps already; only a change counts)."""
        taken = self.channel.taken()
        self.in_place = (
            round_in_place(self.in_place, generation, time.monotonic(), taken, ranks)
            if in_place
            else None
        )
        self.clock = StepClock.start(group_step(self.channel.steps()))

    def in_place_refusal(self, pids: Mapping[int, int], generation: int) -> str | None:
        """Why the running workers cannot take the next round in place, or None."""
        now = time.monotonic()
        self.clock = self.clock.observe(group_step(self.channel.steps()), now)
        untaken = self._untaken(pids)
        return in_place_refusal(
            silent_for=unresponsive(self.clock, now, self.in_place, untaken),
            timeout=self.timeout,
            stopped=stopped_ranks(pids),
            asked=[r for r, g in self.channel.regroup_requests().items() if g >= generation],
            ranks=pids,
        )

    def hang(self, pids: Mapping[int, int]) -> str | None:
        """The message of a hang when the workers did no step (nor took their round) for
        the timeout, recorded for the operator; else None. Reads at most every
        :data:`STEP_READ_INTERVAL_S`."""
        now = time.monotonic()
        if self.timeout is None or now - self._read_at < STEP_READ_INTERVAL_S:
            return None
        self._read_at = now
        self.clock = self.clock.observe(group_step(self.channel.steps()), now)
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
