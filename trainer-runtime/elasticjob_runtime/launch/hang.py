"""Hang detection: a worker group that makes no step progress for the hang timeout.

The agent (:mod:`elasticjob_runtime.launch.agent`) runs the clock; its workers tell it their
step through the agent channel (:class:`~elasticjob_runtime.launch.channel.StepReporter`,
called by :meth:`~elasticjob_runtime.checkpoints.manager.CheckpointManager.mark_step`). When the
clock runs out, the agent treats the round as failed, as torch's agent treats a worker
that exited: it stops the workers (a stopped process is woken so it can save its last
step and exit) and restarts the group, which costs one of ``--max-restarts``. The hang
is recorded in the run's etcd (:class:`~elasticjob_runtime.etcd.records.Hang`, one key per
round) for the operator, which has the Kubernetes access to say so in the job's events
and status.

When the clock runs (:class:`StepClock`): not from the round's start, but from the first
step its workers complete. Rendezvous, restoring a checkpoint, warm-up and the first
step (compilation, allocator growth, data loader start) can take any time, and none of
it reports a step, so none of it can be told from a hang; once a step has been done, the
timeout is the longest gap between two steps. A group whose script never calls
``mark_step`` is never judged hung.

What counts as the group's step: the lowest step any local worker reported. A worker
that stops stops that number; its peers block in the step's collective and stop too.

A round handed to running workers in place (:class:`InPlaceRound`) must be taken: a worker
that froze after it offered to regroup in place still looks like one that can, takes
nothing and reports nothing, and the round's other members wait in it for ever. So the
wait for a worker to take the round counts as a stall (:func:`unresponsive`): one that
neither steps nor takes it for the hang timeout is a hang. And a round is not handed in
place to workers that cannot be told from hung ones (:func:`in_place_refusal`): they
are restarted into it instead, as the agent that declared the hang restarts its own.

Pure, apart from reading the environment; what ``/proc`` says of a worker is
:mod:`elasticjob_runtime.launch.process_state`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from elasticjob_runtime import contract

# Characters of a step report: every write covers the whole number, never a tail of an
# older, longer one.
# Shorter timeouts than this are refused by the operator's CRD: a step, a checkpoint
# save at a step boundary and the agent's reading interval must all fit in it.
MIN_TIMEOUT_S = 10


def group_step(steps: Mapping[int, int]) -> int | None:
    """The group's progress: the lowest step any local worker reported (None: none did)."""
    return min(steps.values()) if steps else None


@dataclass(frozen=True)
class StepClock:
    """The clock of one round, from the steps its workers reported.

    ``last`` is the group step last seen (None: none yet); ``since`` is when it last
    changed, None until the round completed its first step (the clock does not run).
    """

    last: int | None = None
    since: float | None = None

    @classmethod
    def start(cls, step: int | None) -> StepClock:
        """A new round; ``step`` is what the workers had reported before it started
        (workers that regroup in place keep theirs), not yet progress in this round."""
        return cls(last=step)

    def observe(self, step: int | None, now: float) -> StepClock:
        """The clock after seeing group step ``step`` at ``now``: any change is progress
        (a restore may go back), no report or the same step is not."""
        if step is None or step == self.last:
            return self
        return replace(self, last=step, since=now)

    def stalled(self, now: float) -> float:
        """Seconds since the last progress; 0 while the clock does not run."""
        return 0.0 if self.since is None else max(0.0, now - self.since)

    def hung(self, now: float, timeout: float) -> bool:
        return self.since is not None and now - self.since >= timeout


# A round that opens while the workers here have been silent (no step, no round taken,
# no new one asked for) for this share of the hang timeout restarts them rather than
# regrouping them in place (in_place_refusal).
IN_PLACE_SILENCE_SHARE = 0.5


@dataclass(frozen=True)
class InPlaceRound:
    """A round handed to the running workers in place: the generation each must take,
    and since when the agent has been waiting for them to."""

    generation: int
    since: float

    def untaken(self, taken: Mapping[int, int], ranks: Iterable[int]) -> list[int]:
        """The local ranks whose worker has not taken the round (``taken``: local rank ->
        the generation it last took)."""
        return sorted(rank for rank in ranks if taken.get(rank, -1) < self.generation)


def round_in_place(
    previous: InPlaceRound | None,
    generation: int,
    now: float,
    taken: Mapping[int, int],
    ranks: Iterable[int],
) -> InPlaceRound:
    """The handover of round ``generation`` at ``now``. A worker that still owes the round
    handed over before has been waited for since that one: rounds that keep coming must
    not restart the wait for a worker that takes none."""
    if previous is not None and previous.untaken(taken, ranks):
        return InPlaceRound(generation, previous.since)
    return InPlaceRound(generation, now)


def unresponsive(
    clock: StepClock, now: float, in_place: InPlaceRound | None = None, untaken: Sequence[int] = ()
) -> float:
    """Seconds the workers have neither stepped (the clock) nor taken the round handed to
    them in place (``untaken``: the ranks that owe it): a healthy worker takes a round at
    its next step boundary, or at once when its collective failed, so the hang timeout,
    the longest gap between two steps, bounds both."""
    owed = now - in_place.since if in_place is not None and untaken else 0.0
    return max(clock.stalled(now), owed)


def in_place_refusal(
    *,
    silent_for: float,
    timeout: float | None,
    stopped: Sequence[int],
    asked: Collection[int],
    ranks: Iterable[int],
) -> str | None:
    """Why the running workers must be restarted into the next round rather than handed it
    in place, or None: they may regroup in place.

    A stopped process (SIGSTOP, a debugger) takes no round. With a hang timeout, workers
    that have been silent (:func:`unresponsive`) for half of it cannot be told from hung
    ones: the agents that declared the hang opened this round at the full timeout, and
    this agent sees the same stall a moment earlier or later. Workers that asked for a new
    round in the running one (``asked``) are alive and waiting for it, however long the
    group stalled."""
    if stopped:
        return f"local rank {_ranks(stopped)} is stopped and cannot take a round"
    if timeout is None or silent_for < timeout * IN_PLACE_SILENCE_SHARE:
        return None
    silent = [rank for rank in ranks if rank not in asked]
    if not silent:
        return None
    return (
        f"local rank {_ranks(silent)} did no step and took no round for {silent_for:.0f} s "
        f"(hang timeout {timeout:g} s) and cannot be told from a hung worker"
    )


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def hung_after(
    history: list[tuple[float, int | None]], start_step: int | None, now: float, timeout: float
) -> bool:
    """Whether a round that started with ``start_step`` reported and then saw ``history``
    (time, group step) is hung at ``now``: :class:`StepClock` folded over the history."""
    clock = StepClock.start(start_step)
    for at, step in history:
        clock = clock.observe(step, at)
    return clock.hung(now, timeout)


def parse_timeout(text: str, source: str) -> float | None:
    """A hang timeout in seconds from ``text`` (empty or 0: off); ValueError naming
    ``source`` (a flag or a variable) and the fix otherwise."""
    text = text.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(
            f"{source}={text!r}: give the hang timeout in seconds, a positive number "
            "(0 or empty turns hang detection off)"
        )
    return seconds or None


def timeout_from_env(env: Mapping[str, str]) -> float | None:
    """``ELASTICJOB_HANG_TIMEOUT`` (seconds; the operator sets it from
    ``spec.hangTimeoutSeconds``), or None when hang detection is off."""
    return parse_timeout(env.get(contract.HANG_TIMEOUT, ""), contract.HANG_TIMEOUT)


def hang_message(
    step: int | None, stalled: float, timeout: float, untaken: Sequence[int] = ()
) -> str:
    """One line for the agent's log and the operator's event."""
    at = "before any step" if step is None else f"after step {step}"
    owed = f", and local rank {_ranks(untaken)} never took its new round" if untaken else ""
    return (
        f"no training step for {stalled:.0f} s (hang timeout {timeout:g} s), {at}{owed}: "
        "restarting the worker group"
    )
