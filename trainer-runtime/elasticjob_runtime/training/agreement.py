"""When the ranks compare their training state, and what a mismatch does.

The comparison itself (fingerprints, which ranks differ, the message) is
:mod:`elasticjob_runtime.training.fingerprint`; this module is the schedule (at the first step
after every regroup and restore, and every ``check_every`` steps) and the action:
stop with :class:`~elasticjob_runtime.training.fingerprint.DivergenceError`, or copy rank 0's
state to every rank (``on_divergence="resync"``). Either way the operator hears of it
through the run's etcd.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.progress import divergence_reporter_from_env
from elasticjob_runtime.etcd.records import DIVERGENCE_ACTIONS, Divergence
from elasticjob_runtime.training.fingerprint import (
    DivergenceError,
    as_signed,
    disagreements,
    disagreements_within,
    divergence_message,
    fingerprint,
)

if TYPE_CHECKING:
    from elasticjob_runtime.training.replication import Replication
    from elasticjob_runtime.training.worker_rounds import WorkerRounds

log = logging.getLogger(__name__)


def gather_rows(mine: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's row of int64 values, in rank order."""
    tensor = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [[int(v) for v in row.tolist()] for row in gathered]


def report_divergence(step: int, action: str, message: str) -> None:
    """Tell the operator (the run's etcd): it fails the job, or says that the ranks
    were resynced. Every rank writes the step's one key before it stops: a pod that
    fails before the record exists would be replaced as an ordinary failure."""
    report = divergence_reporter_from_env()
    if report is not None:
        pod = os.environ.get(contract.POD_NAME) or socket.gethostname()
        report(Divergence(step, action, message, pod, time.time()))


class Agreement:
    """The agreement check's schedule and its action on a mismatch."""

    def __init__(self, every: int, on_divergence: str) -> None:
        if every < 0:
            raise ValueError(f"check_every must be 0 (off) or more (got {every})")
        if on_divergence not in DIVERGENCE_ACTIONS:
            raise ValueError(
                f"on_divergence must be one of {', '.join(DIVERGENCE_ACTIONS)} "
                f"(got {on_divergence!r})"
            )
        self.every = every
        self.on_divergence = on_divergence
        self.resyncs = 0  # times rank 0's state was copied over a divergence
        # compare at the next commit, the first after a regroup or restore: why, or None
        self.next_reason: str | None = None

    def due(self, step: int) -> str | None:
        """Why the ranks compare after committing ``step``, or None (then and there)."""
        when = self.next_reason
        if when is None and self.every and step % self.every == 0:
            when = f"checked every {self.every} steps"
        self.next_reason = None
        return when

    def check(self, when: str, step: int, replica: Replication, rounds: WorkerRounds) -> bool:
        """Compare every rank's fingerprints of what ``replica`` says every rank holds
        alike; stop (or resync) when they differ. Returns whether the state was resynced
        (the round's plan must start anew)."""
        if rounds.world_size < 2:
            return False
        checked = replica.checked()
        cohort, alike = replica.checked_within_replicas()
        mine = [cohort, *(as_signed(fingerprint(v)) for v in (*checked.values(), *alike.values()))]
        rows = gather_rows(mine, rounds.device)
        split = 1 + len(checked)
        found = disagreements(list(checked), [row[1:split] for row in rows])
        found += disagreements_within(
            list(alike), [row[0] for row in rows], [row[split:] for row in rows]
        )
        if not found:
            return False
        message = divergence_message(step, when, found)
        report_divergence(step, self.on_divergence, message)
        if self.on_divergence == "resync":
            log.error("%s; copying rank 0's state to every rank (on_divergence='resync')", message)
            replica.resync(rounds)
            self.resyncs += 1
            return True
        channel = rounds.channel
        if channel is not None:
            channel.say_fatal(message)  # the agent must not restart into the same bug
        raise DivergenceError(message)
