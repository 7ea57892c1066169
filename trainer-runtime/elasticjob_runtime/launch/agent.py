"""torch's ``LocalElasticAgent`` with warm spares, telling a broken group from a local fault.

Workers start from warm spares (:mod:`elasticjob_runtime.launch.spare_pool`) when the agent
is given a :class:`~elasticjob_runtime.launch.spare_pool.SparePool`: the first round and every
restart hand the round to processes that have already imported torch and the script's
imports, and fresh spares warm up while the round trains.

When a peer node dies, the workers here usually fail too (gloo reports the closed
connection) before the peer's lease runs out. Stock torch charges that to this
node's ``--max-restarts``, so a long job on preemptible nodes runs out of restarts
although nothing here ever failed. This agent gives the etcd-v3 rendezvous one
lease TTL to explain a failure: if a peer left or a new round opened meanwhile,
the failure is reported as a membership change, which restarts the workers into
the next round without spending a restart. A worker killed by a signal here
(SIGKILL, the OOM killer, a segfault) is a local fault and is charged at once.

Before it stops workers whose round lost a peer, the agent tells them so through the
channel (``group-broken``, :mod:`elasticjob_runtime.launch.channel`): their step in flight sits
in a collective that can never finish, so the checkpoint's SIGTERM path saves the last
completed step at once instead of waiting its grace for a step boundary (that grace was
5 s of a frozen node).

With a hang timeout (``--hang-timeout``, ``ELASTICJOB_HANG_TIMEOUT``), a group whose
workers completed no step for that long is restarted as a failed round (it costs a
restart, like a worker that exited: a hang that comes back every time must end in a
failed pod, not a loop) and recorded in the run's etcd for the operator
(:mod:`elasticjob_runtime.launch.hang` says when the clock runs and why). A round handed to the
running workers in place that one of them does not take within the hang timeout is such
a hang too; and workers that are stopped, or silent for half the timeout, are restarted
into a new round rather than handed it in place
(:func:`~elasticjob_runtime.launch.hang.in_place_refusal`): a worker that froze still looks as if
it could regroup, and would hold the round for ever.

When its workers have finished, torch's agent waits in an exit barrier for every agent of
the round (up to 300 s). A peer whose lease is gone (a scale-down that deleted its pod as
training ended, a node lost after the last step) will never arrive, so this agent stops
waiting for it at once instead of holding its pod, and the job's success, for minutes.

The agent also says when its workers first ran in a round (``joined``, set then and
never cleared): the pod's readiness probe (:mod:`elasticjob_runtime.launch.health`). It stays
set through later rendezvous on purpose: the node lifecycle controller marks a pod not
ready when its node stops answering only if the pod is ready, and the operator reads that
flip to replace the pods of a lost node, so a pod that went not ready at every
rendezvous would hide its node's loss during those windows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.utils import store as store_util

from elasticjob_runtime import contract
from elasticjob_runtime.launch.channel import AgentChannel, new_channel_dir, sweep_abandoned
from elasticjob_runtime.launch.departing import Departing, DepartureRequest, stop_signal
from elasticjob_runtime.launch.hang import group_step
from elasticjob_runtime.launch.hang_watch import HangWatch
from elasticjob_runtime.launch.monitor_wake import MonitorWake
from elasticjob_runtime.launch.process_state import dying_ranks
from elasticjob_runtime.launch.spare import parse_worker_command
from elasticjob_runtime.launch.spare_pool import (
    REFILL_DELAY_S,
    SparePool,
    refill_due,
    start_processes_warm,
)
from elasticjob_runtime.launch.spare_template import reap_orphans
from elasticjob_runtime.launch.torch_internals import (
    TERMINAL_STATE_SYNC_ID,
    TorchAgent,
    starting_workers_with,
)
from elasticjob_runtime.rendezvous.api import membership_of
from elasticjob_runtime.rendezvous.etcd_store import EtcdV3Store, RoundAbandoned
from elasticjob_runtime.rendezvous.leases import notice_within
from elasticjob_runtime.rendezvous.membership import RoundCause

log = logging.getLogger(__name__)

# How long a new agent waits for its spares' imports before it joins a round anyway.
SPARES_WARM_TIMEOUT_S = 120.0
# How often a monitor pass reaps the orphans a subreaper (or PID 1) inherits: a read of
# /proc/self/task/*/children, so never a zombie for longer than this.
REAP_EVERY_S = 1.0
# What a hung worker's entry in torch's failure report says it exited with (it did not:
# the agent stopped it).
HANG_EXITCODE = 1

# After failed workers, how much longer than a lease's worst case to wait for the round
# to report a lost peer before the failure counts as this node's own.
MEMBERSHIP_NOTICE_MARGIN_S = 0.5

# How often the agent reads its workers' steps (torch's loop asks every 0.1 s): a hang is
# seen at most this late, and the spares are refilled at most this late.
STEP_READ_INTERVAL_S = 0.5
# What torch's loop sleeps between monitor passes once the agent waits in its own pass
# instead (monitor_wake.py): torch requires more than 0; the wait is the interval.
TORCH_LOOP_SLEEP_S = 0.001


def local_fault(exitcodes: list[int]) -> bool:
    """A worker that died by a signal failed here; an exception may be a peer's doing."""
    return any(code < 0 for code in exitcodes)


def steps_due(read_at: float, now: float, wanted: bool) -> bool:
    """Whether this monitor pass reads the workers' step files (last read at ``read_at``):
    at most every :data:`STEP_READ_INTERVAL_S`, and only when a reader wants them
    (``wanted``: the hang watch judges hangs, or spares wait for a refill). One read
    serves every reader of the pass, so they all see the same steps."""
    return wanted and now - read_at >= STEP_READ_INTERVAL_S


def gone_from_exit_barrier(lost: list[str]) -> str | None:
    """Why the exit barrier cannot complete: participants of the round whose lease is gone
    never reach it (their agent was stopped or died), so waiting for them only delays
    this pod's exit, and the job's success, by the barrier's timeout. None: keep waiting."""
    if not lost:
        return None
    return f"{', '.join(lost)} left the round and will not reach the exit barrier"


def kill_orphans(result: RunResult) -> None:
    """SIGKILL what a worker that exited left behind in its session (its DataLoader
    workers, any process it forked). They hold copies of its sockets, so its peers
    saw no connection reset until they went (a DataLoader worker notices its parent
    is gone only within 5 s), and torch's agent signals only workers still alive."""
    for failure in result.failures.values():
        if failure.pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(failure.pid, signal.SIGKILL)  # a worker leads its own session


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class MembershipAwareAgent(TorchAgent):
    """``LocalElasticAgent`` that starts workers from warm spares and does not charge
    restarts for peers that left."""

    def __init__(
        self,
        *args: Any,
        warm_spares: bool = False,
        warm_spare_count: int | None = None,  # None: one per local rank
        warm_spare_fork: bool = True,  # spares forked from a warm template
        warm_imports: tuple[str, ...] = (),
        joined: threading.Event | None = None,
        hang_timeout: float | None = None,
        departure: DepartureRequest | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        # where a new run's goodput ledger starts counting (goodput/keeper.py): in this
        # process's environment, which its workers and warm spares inherit alike (a
        # variable set only in a worker's own environment made every spare a mismatch)
        os.environ.setdefault(contract.AGENT_STARTED, f"{time.time():.3f}")
        # When a round last started workers (from spares), and the step it started at:
        # the pool is refilled once that round trains (spare_pool.refill_due).
        self._refill: tuple[float, int | None] | None = None
        self._steps_read_at = -1.0  # when a monitor pass last read the steps (steps_due)
        self._hung = False  # the group being stopped hung: wake and stop it at once
        # Set once this node's workers first ran in a round (the readiness probe reads it).
        self.joined = joined if joined is not None else threading.Event()
        # Every file between this agent and its workers (channel.py), named to them (and
        # to the spares, which must see the same environment) by one variable.
        swept = sweep_abandoned()  # those of agents killed before they could
        if swept:
            log.info("removed %d channel directories of agents that were killed", len(swept))
        self._notes = new_channel_dir()
        self._channel = AgentChannel(self._notes)
        # None with torch's own rendezvous backends: the agent then behaves as torch's.
        self._membership = membership_of(self.worker_group.spec.rdzv_handler)
        self.hang_watch = HangWatch(self._channel, hang_timeout, self._membership)
        # A SIGTERM while a round trains hands this node's place over (departing.py).
        self._departing = (
            Departing(departure, self._membership, self._channel)
            if departure is not None and self._membership is not None
            else None
        )
        os.environ[contract.AGENT_CHANNEL] = str(self._notes)
        self._generation = 0
        self._next_start = StartKind()
        self._spares: SparePool | None = None
        self._joined_once = False
        self._reaped_at = 0.0
        spec = self.worker_group.spec
        # A pass waits up to the interval asked for, and starts at once when a worker
        # exits, rings the agent's bell, or the round watch sees a change, or a SIGTERM
        # asks for a departure (monitor_wake.py).
        self._wake = MonitorWake(self._channel.bell())
        if departure is not None:
            departure.on_taken = self._wake.nudge
        self._monitor_every = spec.monitor_interval
        spec.monitor_interval = TORCH_LOOP_SLEEP_S
        if self._membership is not None:
            self._membership.wake_on_change(self._wake.nudge)
        if warm_spares and isinstance(spec.entrypoint, str):
            target = parse_worker_command(
                spec.entrypoint, [str(a) for a in spec.args], sys.executable
            )
            if target is None:
                log.info("warm spares off: the worker command is not `python [-u] [-m] target`")
            else:
                self._spares = SparePool(
                    target,
                    spec.local_world_size,
                    warm_imports=warm_imports,
                    size=warm_spare_count,
                    fork=warm_spare_fork,
                )
                self._spares.fill()  # they warm up while the first rendezvous runs

    def rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._spares is not None and not self._joined_once:
            # Join only once the spares are warm: a running group that this agent's
            # round interrupts then pauses for the switch, not for our imports.
            started = time.monotonic()
            if not self._spares.wait_warm(SPARES_WARM_TIMEOUT_S):
                log.warning(
                    "warm spares not ready after %.0f s; joining anyway", SPARES_WARM_TIMEOUT_S
                )
            log.info(
                "warm spares ready in %.1f s; joining the rendezvous", time.monotonic() - started
            )
        self._joined_once = True
        while True:
            try:
                super().rendezvous(worker_group)
                return
            except RoundAbandoned as exc:
                # torch's rank assignment waited in the round's store for a participant that
                # left the round after it was sealed (the store's give_up says why): join
                # the next round now rather than at the store's timeout (300 s)
                log.info("the round broke up before its workers started (%s); next round", exc)

    def run(self, role: str = "default") -> Any:
        try:
            result = super().run(role)
            if self._membership is not None and not result.is_failed():
                self._membership.mark_finished()  # before torch's launcher closes the run
            return result
        finally:
            self._accept_departure(False)
            if self._spares is not None:
                self._spares.close()
            if self._membership is not None:
                self._membership.wake_on_change(lambda: None)  # its watch may outlive us
            self._wake.close()
            shutil.rmtree(self._notes, ignore_errors=True)

    def _accept_departure(self, accepting: bool) -> None:
        """Whether a SIGTERM now asks for a departure (a round trains) or stops the agent."""
        if self._departing is not None:
            self._departing.request.accepting = accepting

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        # close() stops SIGTERM asking for a departure, as _accept_departure(False) would
        if self._departing is not None and self._departing.request.close():
            log.info(
                "SIGTERM: the round changed before this node announced its departure; "
                "stopping the workers (they save their last step) instead of regrouping"
            )
            raise stop_signal()
        # torch's loop sets the state before it calls this: HEALTHY is its membership
        # branch (a peer left or came); FAILED/UNHEALTHY means a local worker exited.
        if worker_group.state == WorkerState.HEALTHY:
            # (workers whose exit the monitor has seen are reaped, gone: not waited for)
            dying = dying_ranks(self.worker_pids())
            if dying:
                # The round came from its death (its peers' collectives failed first):
                # the next monitor pass sees it exit, a local failure, charged as one.
                log.info(
                    "a round opened while local rank %s exits; its failure is handled first",
                    ",".join(map(str, dying)),
                )
                return
        if worker_group.state == WorkerState.HEALTHY and self._workers_regroup_in_place():
            # Read now, not at the last monitor pass: the round opens at this moment.
            refused = self.hang_watch.in_place_refusal(
                self.worker_pids(), self._generation, self._channel.steps(), time.monotonic()
            )
            if refused is not None:
                # It would never take the round, and its other members would wait in it.
                log.warning("not regrouping the workers in place: %s; restarting them", refused)
                self._hung = True  # stopped as a hang: woken, their step in flight dropped
            elif self._channel.begin_regroup():
                try:
                    self._regroup_in_place(worker_group)
                finally:
                    self._channel.end_regroup()
                return
            else:
                # It may exit before the round stands, and the round's other members would
                # wait in it for a worker that never comes (channel.py).
                log.info(
                    "a worker has finished training; restarting the workers into the next "
                    "round (they resume from the final checkpoint)"
                )
        super().restart_workers(worker_group)

    def _workers_regroup_in_place(self) -> bool:
        """Every local worker runs the training-loop API and is the process it said it was."""
        pids = self.worker_pids()
        offered = self._channel.in_place_pids()
        return bool(pids) and all(offered.get(rank) == pid for rank, pid in pids.items())

    def _regroup_in_place(self, worker_group: WorkerGroup) -> None:
        """The next round for the running workers: rendezvous, then hand each its new
        rank and world through the channel; no process stops or starts."""
        lost = self._membership.peers_lost() if self._membership is not None else []
        log.info(
            "regrouping the running workers in place%s",
            f" (the round lost {lost}: they abandon its collectives)" if lost else "",
        )
        self._next_start = StartKind(in_place=True, abort=bool(lost))
        try:
            self.initialize_workers(worker_group)
        finally:
            self._next_start = StartKind()

    def stop_workers(self, worker_group: WorkerGroup) -> None:
        self._accept_departure(False)
        if self._membership is not None:
            lost = self._membership.peers_lost()
            if lost:
                log.info("the round lost %s: workers save their last step without waiting", lost)
                self._channel.mark_group_broken()
        if self._hung:
            if self._membership is not None:  # the round it opens says why (goodput)
                self._membership.next_cause = RoundCause.HANG
            # The step in flight will not finish: save the last completed one at once. A
            # stopped (SIGSTOP) worker would hold its SIGTERM until torch's SIGKILL 30 s
            # later; SIGTERM first, then SIGCONT, wakes it into the save-and-exit path.
            self._hung = False
            self._channel.mark_group_broken()
            signal_all(self.worker_pids().values(), signal.SIGTERM)
            signal_all(self.worker_pids().values(), signal.SIGCONT)
        self._channel.forget_workers()
        super().stop_workers(worker_group)

    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._channel.clear_group_broken()
        self._generation += 1
        generation, kind, running = self._generation, self._next_start, self.workers_context
        spares = self._spares

        # the etcd-v3 rendezvous round every node of the group shares (torch's own
        # backends have none: the workers' Run then names its group by the run id alone)
        membership, run_id = self._membership, worker_group.spec.rdzv_handler.get_run_id()
        round_id = f"{run_id}/{membership.round_number}" if membership is not None else ""

        cause = membership.round_cause if membership is not None else ""

        def start(**kwargs: Any) -> PContext:
            for env in kwargs["envs"].values():
                if round_id:
                    env[contract.ROUND_ID] = round_id
                if cause:
                    env[contract.ROUND_CAUSE] = cause
            self._channel.deliver(generation, kwargs["envs"], kind.abort)
            if kind.in_place and running is not None:
                return running
            return start_processes_warm(spares, **kwargs)  # torch's own where it must be

        with starting_workers_with(start):
            started = super().start_workers(worker_group)
        self.joined.set()
        in_place = kind.in_place and running is not None
        # One read for both: the step the refill waits to see change, the hang clock's start.
        steps, now = self._channel.steps(), time.monotonic()
        if spares is not None and not in_place:
            if spares.forks():
                spares.fill()  # a fork from the warm template: nothing to wait for
            else:
                self._refill = (now, group_step(steps))
        ranks = range(worker_group.spec.local_world_size)
        self.hang_watch.round_started(generation, ranks, in_place, steps, now)
        self._accept_departure(True)
        return started

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._wake.wait(self.worker_pids().values(), self._monitor_every)
        result = super().monitor_workers(worker_group)
        if self._departing is not None:
            self._departing.follow_mark()  # marked leaving by a scale-down: depart
        if self._departing is not None and self._departing.under_way:
            # announce, wait, hand over; SignalException once it is time to stop
            exited = result.state != WorkerState.HEALTHY
            self._departing.step(self._workers_regroup_in_place, exited)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state == WorkerState.SUCCEEDED:
            self._accept_departure(False)  # a SIGTERM in the exit barrier stops the agent
        now = time.monotonic()
        if now - self._reaped_at >= REAP_EVERY_S:
            self._reaped_at = now
            reap_orphans()  # a dead worker's DataLoader workers, inherited once they exit
        steps = self._read_steps(now)
        self._refill_spares(steps, now)
        if result.state == WorkerState.HEALTHY:
            if self._channel.regroup_requested(self._generation) and (
                self._workers_regroup_in_place()
            ):
                # A collective failed with no membership change (yet): a new round for
                # everyone; the other agents see this node waiting and follow.
                log.info("a worker's collective failed; opening the next round")
                self.restart_workers(worker_group)
                return result
            return self._check_hang(worker_group, steps, now) or result
        if result.state not in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            return result
        kill_orphans(result)
        fatal = self._channel.fatal()
        if fatal is not None:
            # A restart would resume from a checkpoint into the same script bug: fail now.
            log.error("not restarting the workers: %s", fatal)
            self.stop_restarting()
            return result
        membership = self._membership
        if membership is None:
            return result
        if local_fault([failure.exitcode for failure in result.failures.values()]):
            return result
        # A dead peer's key outlives it by up to notice_within(ttl); the margin is for a
        # busy etcd and the watch that tells us.
        reason = membership.wait_for_membership_change(
            notice_within(membership.lease_ttl) + MEMBERSHIP_NOTICE_MARGIN_S
        )
        if reason is None:
            return result
        log.info("workers failed because the group changed (%s); not counted as a restart", reason)
        # HEALTHY sends torch's loop to its membership branch: num_nodes_waiting() > 0,
        # so it restarts the workers into the next round without spending a restart.
        return RunResult(state=WorkerState.HEALTHY)

    def _read_steps(self, now: float) -> dict[int, int] | None:
        """The workers' steps for this monitor pass's readers, or None when the pass reads
        none (:func:`steps_due`): the one read of the step files per pass."""
        wanted = self.hang_watch.watching or (self._spares is not None and self._refill is not None)
        if not steps_due(self._steps_read_at, now, wanted):
            return None
        self._steps_read_at = now
        return self._channel.steps()

    def _refill_spares(self, steps: Mapping[int, int] | None, now: float) -> None:
        """Replace the spares the running round took, once it trains (spare_pool.refill_due);
        judged only on a pass that read the ``steps``, as the hang is."""
        if self._spares is None or self._refill is None or steps is None:
            return
        handed_at, start_step = self._refill
        step = group_step(steps)
        stepped = step is not None and step != start_step
        # only read once the plain delay is past: the in-place offers are a directory scan
        late = not stepped and now - handed_at >= REFILL_DELAY_S
        reports_steps = late and bool(self._channel.in_place_pids())
        if refill_due(handed_at, stepped, now, REFILL_DELAY_S, reports_steps):
            self._refill = None
            self._spares.fill()

    def exit_barrier(self) -> None:
        """torch's exit barrier, except that it ends as soon as a participant's lease is
        gone (:func:`gone_from_exit_barrier`); torch would wait its 300 s for it."""
        membership = self._membership
        store = self.rendezvous_store
        world = self.worker_group.group_world_size
        if membership is None or not isinstance(store, EtcdV3Store) or world is None:
            super().exit_barrier()
            return
        started = time.monotonic()
        store.give_up = lambda: gone_from_exit_barrier(membership.peers_lost())
        try:
            with self.in_exit_barrier():
                store_util.barrier(
                    store=store,
                    world_size=world,
                    key_prefix=TERMINAL_STATE_SYNC_ID,
                    barrier_timeout=self.exit_barrier_timeout,
                )
        except RoundAbandoned as exc:
            log.info("not waiting for the other agents to finish: %s", exc)
        except Exception as exc:  # as torch's: a failed barrier only ends the wait
            log.warning("exit barrier failed after %.1f s: %s", time.monotonic() - started, exc)
        finally:
            store.give_up = None

    def _check_hang(
        self, worker_group: WorkerGroup, steps: Mapping[int, int] | None, now: float
    ) -> RunResult | None:
        """A failed round when the workers hung (hang_watch.py), else None; judged only on
        a pass that read the ``steps``."""
        if steps is None:
            return None
        pids = self.worker_pids()
        if self.hang_watch.hang(pids, steps, now) is None:
            return None
        self._hung = True
        failures = {
            worker.global_rank: ProcessFailure(
                worker.local_rank, pids.get(worker.local_rank, -1), HANG_EXITCODE, ""
            )
            for worker in worker_group.workers
        }
        return RunResult(state=WorkerState.FAILED, failures=failures)


@dataclass(frozen=True)
class StartKind:
    """How the next round reaches this node's workers."""

    in_place: bool = False  # the running workers regroup; nothing is started
    abort: bool = False  # the round they leave lost a peer
