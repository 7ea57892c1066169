"""Every rank keeps the run's goodput ledger (ledger.py) from its own step loop; global
rank 0 publishes its copy with the progress record (etcd/progress.py).

Every rank, not only rank 0, so that whichever rank is 0 after a regroup publishes a
ledger that saw everything. When a group forms, every rank takes one copy
(training/ledger_sync.py): the old rank 0's if it lived through the regroup, else
another survivor's; a process new to the group (a replacement, a joiner: its agent's
worker often gets rank 0) never publishes a copy of its own. When every rank is new (the
run starts, or its group restarted), rank 0 reads back the newest ledger a rank 0
published (:func:`read_published`: the progress record's, or the ledger key's once that
record went with its lease), and the time since then is the restart's pause; a run that
never published one opens a new ledger at its first agent's start
(``ELASTICJOB_AGENT_STARTED``, which ``elasticjob-run`` sets), else at the earliest
rank's process start.

Times are unix seconds (``time.time``): a ledger moves between processes and nodes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdError
from elasticjob_runtime.etcd.progress import ProgressTarget, progress_target, published_ledger
from elasticjob_runtime.etcd.tls import open_client
from elasticjob_runtime.goodput import ledger as gl
from elasticjob_runtime.goodput.ledger import Cause, Ledger

log = logging.getLogger(__name__)

# How long rank 0 of a new group waits for etcd to read the published ledger back.
READ_TIMEOUT_S = 2.0


class Steady(NamedTuple):
    """Commits since the last event, not yet folded into the ledger: a steady step only
    moves these four, and building a new Ledger per step cost more than 1 % of a 1 ms
    step (bench: ledger-cost)."""

    through: float
    training: float
    step: int
    typical: float | None

    def fold(self, ledger: Ledger) -> Ledger:
        return replace(
            ledger,
            through=self.through,
            training=self.training,
            step=self.step,
            typical_step=self.typical,
        )


class LedgerKeeper:
    """One rank's copy of the ledger, moved on by the step loop's moments.

    Its state is one (ledger, steady commits) pair, replaced whole: the progress
    publisher reads :attr:`ledger` from its own thread and always sees a pair that
    belongs together."""

    def __init__(self, ledger: Ledger, clock: Callable[[], float] = time.time) -> None:
        self._state: tuple[Ledger, Steady | None] = (ledger, None)
        self._clock = clock
        self._noticed: float | None = None  # when the regroup under way began

    @property
    def ledger(self) -> Ledger:
        ledger, steady = self._state
        return ledger if steady is None else steady.fold(ledger)

    def _set(self, ledger: Ledger) -> None:
        self._state = (ledger, None)

    def committed(self, step: int) -> None:
        """Step ``step`` committed now (before its saves: :meth:`saved`). A steady step
        (the run started, no recovery under way, a new step, a clock that did not go
        back) moves only :class:`Steady`: what ``gl.committed`` would do, without the
        Ledger it would build."""
        at = self._clock()
        ledger, steady = self._state
        if steady is None:
            if not ledger.started or ledger.recovering is not None:
                self._set(gl.committed(ledger, step, at))
                return
            steady = Steady(ledger.through, ledger.training, ledger.step, ledger.typical_step)
        through, training, last, typical = steady
        if step > last and at >= through:
            work = at - through
            self._state = (ledger, Steady(at, training + work, step, gl.typical(typical, work)))
        else:
            self._set(gl.committed(steady.fold(ledger), step, at))

    def resynced(self, began: float) -> None:
        """The ranks diverged and rank 0's state was copied to every rank, from ``began``
        (the check) to now: a recovery, whose pause ends at the next commit."""
        self._set(gl.paused(gl.interrupted(self.ledger, Cause.DIVERGENCE, began), self._clock()))

    def saved(self) -> None:
        """The commit's saves are done: the time they took is checkpoint time."""
        self._set(gl.saved(self.ledger, self._clock()))

    def regroup_began(self) -> None:
        """A regroup starts (a collective broke, or a new round was announced): the
        moment its pause is counted from. A regroup tried again keeps the first one's."""
        if self._noticed is None:
            self._noticed = self._clock()

    def group_changed(self, cause: str) -> None:
        """The regroup has its next round (``cause``: why it came), before the group
        forms: every rank then holds the recovery, which the group's sync hands to the
        ranks new to it. A retry books its time to the same recovery."""
        self._set(gl.interrupted(self.ledger, cause, self._noticed or self._clock()))

    def regrouped(self) -> None:
        """The regroup is done: its time so far is its pause (the rest comes with the
        first step after it)."""
        self._noticed = None
        self._set(gl.paused(self.ledger, self._clock()))

    def finished(self) -> None:
        """The run ends: a recovery under way ends with it."""
        self._set(gl.finished(self.ledger, self._clock()))

    def formed(self, world: int) -> None:
        """The group formed with ``world`` ranks (the timeline's group size)."""
        self._set(gl.formed(self.ledger, world))

    def adopt(self, other: Ledger) -> None:
        """Take ``other`` (the copy the group chose) in place of this one."""
        self._set(other)

    def encoded(self) -> dict[str, Any]:
        return gl.encode(self.ledger)


# The round causes (rendezvous.membership.RoundCause, through contract.ROUND_CAUSE) that
# name a recovery's cause as they are; "start" names none.
TOLD: dict[str, str] = {
    "crash": Cause.CRASH,
    "node-lost": Cause.NODE_LOST,
    "hang": Cause.HANG,
    "join": Cause.JOIN,
    "departure": Cause.DEPARTURE,
}


def regroup_cause(failed: bool, old_world: int, new_world: int, told: str | None = None) -> str:
    """Why this regroup happened. ``told``: the cause the next round's opener wrote in it
    (a crash, a lost or frozen node, a hang, a join, a departure), which a survivor could
    not see for itself. Without it, as far as a rank can tell: a broken collective is a
    failure, a planned regroup that grew the group a join and one that shrank it a
    departure."""
    if told in TOLD:
        return TOLD[told]
    if failed:
        return Cause.FAILURE
    if new_world > old_world:
        return Cause.JOIN
    if new_world < old_world:
        return Cause.DEPARTURE
    return Cause.FAILURE


def fresh_keeper(env: Mapping[str, str] = os.environ) -> LedgerKeeper:
    """A process's own ledger before its first group forms: opened at its agent's start
    (which a new run keeps: the group takes the earliest)."""
    now = time.time()
    return LedgerKeeper(gl.opened(min(now, agent_started(env) or now)))


def group_start(published: Ledger | None, earliest: float, told: str | None = None) -> Ledger:
    """The ledger of a group of new processes: the run's published one, taken on (the
    group restarted: for a hang, its round says so in ``told``), else a new run's,
    opened at the earliest start among its ranks."""
    if published is not None:
        return gl.restarted(published, Cause.HANG if told == "hang" else Cause.RESTART)
    return gl.opened(earliest)


def agent_started(env: Mapping[str, str]) -> float | None:
    """When this process's agent started (unix time), else when this process did."""
    text = env.get(contract.AGENT_STARTED, "").strip()
    try:
        return float(text) if text else process_started()
    except ValueError:
        log.warning("%s=%r is not a unix time; ignored", contract.AGENT_STARTED, text)
        return process_started()


def process_started() -> float | None:
    """This process's start (unix time) from /proc; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def read_published(
    env: Mapping[str, str] = os.environ,
    read: Callable[[ProgressTarget], dict[str, Any] | None] | None = None,
) -> Ledger | None:
    """The newest ledger the run published, if its progress goes to an etcd that has
    one; None (a new ledger starts) when it has none, cannot be read or is malformed."""
    target = progress_target(env)
    if not isinstance(target, ProgressTarget):
        return None
    doc = (read or _read)(target)
    if doc is None:
        return None
    try:
        return gl.decode(doc)
    except ValueError as exc:
        log.warning("the published goodput ledger is malformed (a new one starts): %s", exc)
        return None


def _read(target: ProgressTarget) -> dict[str, Any] | None:
    try:
        client = open_client(target.etcd, target.tls, timeout=READ_TIMEOUT_S)
    except EtcdError as exc:
        log.warning("goodput ledger not read back (a new one starts): %s", exc)
        return None
    try:
        return published_ledger(client, target.run_id)
    except EtcdError as exc:
        log.warning("goodput ledger not read back (a new one starts): %s", exc)
        return None
    finally:
        client.close()
