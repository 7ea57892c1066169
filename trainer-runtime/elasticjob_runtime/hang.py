"""Hang detection: a worker group that makes no step progress for the hang timeout.

The agent (:mod:`elasticjob_runtime.agent`) runs the clock; its workers tell it their
step through the agent channel (``step-<local rank>``, written by
:meth:`~elasticjob_runtime.checkpoint.CheckpointManager.mark_step` at most every
:data:`REPORT_INTERVAL_S`). When the clock runs out, the agent treats the round as
failed, as torch's agent treats a worker that exited: it stops the workers (a stopped
process is woken so it can save its last step and exit) and restarts the group, which
costs one of ``--max-restarts``. The hang is recorded in the run's etcd
(:class:`~elasticjob_runtime.records.Hang`, one key per round) for the operator, which
has the Kubernetes access to say so in the job's events and status.

When the clock runs (:class:`StepClock`): not from the round's start, but from the first
step its workers complete. Rendezvous, restoring a checkpoint, warm-up and the first
step (compilation, allocator growth, data loader start) can take any time, and none of
it reports a step, so none of it can be told from a hang; once a step has been done, the
timeout is the longest gap between two steps. A group whose script never calls
``mark_step`` is never judged hung.

What counts as the group's step: the lowest step any local worker reported. A worker
that stops stops that number; its peers block in the step's collective and stop too.
Pure, apart from :class:`StepReporter` (a file write) and reading the environment.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from elasticjob_runtime import contract

# Characters of a step report: every write covers the whole number, never a tail of an
# older, longer one.
STEP_WIDTH = 20
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


class StepReporter:
    """A worker's side: its latest step in ``step-<local rank>`` of the agent channel.

    One ``pwrite`` of a fixed-width number into the page cache per step (about a
    microsecond, no fsync): the agent reads the very last step, so the record of a hang
    names the step the group stopped after.
    """

    def __init__(self, directory: str, local_rank: int) -> None:
        self.path = os.path.join(directory, f"step-{local_rank}")
        self._fd: int | None = None

    def report(self, step: int) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._fd, f"{step:>{STEP_WIDTH}}".encode(), 0)
        except OSError:  # the agent went away (its directory with it): nobody to tell
            pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def from_env(cls) -> StepReporter | None:
        """None outside ``elasticjob-run`` (nobody watches the steps there)."""
        directory = os.environ.get(contract.AGENT_CHANNEL)
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, int(os.environ.get("LOCAL_RANK", "0")))


def read_steps(directory: str) -> dict[int, int]:
    """Local rank -> the step its worker last reported (the agent's side)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if not name.startswith("step-"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                out[int(name[len("step-") :])] = int(f.read())
        except (OSError, ValueError):
            continue
    return out


def forget_steps(directory: str) -> None:
    """The workers are being replaced: their reports go with them."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith("step-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def hang_message(step: int | None, stalled: float, timeout: float) -> str:
    """One line for the agent's log and the operator's event."""
    at = "before any step" if step is None else f"after step {step}"
    return (
        f"no training step for {stalled:.0f} s (hang timeout {timeout:g} s), {at}: "
        "restarting the worker group"
    )
