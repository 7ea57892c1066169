"""torch's ``LocalElasticAgent`` with warm spares, telling a broken group from a local fault.

Workers start from warm spares (:mod:`elasticjob_runtime.spare_pool`) when the agent
is given a :class:`~elasticjob_runtime.spare_pool.SparePool`: the first round and every
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

Before it stops workers whose round lost a peer, the agent creates the file named by
``ELASTICJOB_GROUP_BROKEN_FILE``: their step in flight sits in a collective that can
never finish, so the checkpoint's SIGTERM path saves the last completed step at once
instead of waiting its grace for a step boundary (that grace was 5 s of a frozen node).

The agent also says when its workers first ran in a round (``joined``, set then and
never cleared): the pod's readiness probe (:mod:`elasticjob_runtime.health`). It stays
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
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext

from elasticjob_runtime import contract
from elasticjob_runtime.channel import AgentChannel
from elasticjob_runtime.leases import notice_within
from elasticjob_runtime.rendezvous import EtcdV3RendezvousHandler
from elasticjob_runtime.spare import parse_worker_command
from elasticjob_runtime.spare_pool import SparePool, start_processes_warm

log = logging.getLogger(__name__)

# How long a new agent waits for its spares' imports before it joins a round anyway.
SPARES_WARM_TIMEOUT_S = 120.0
# After failed workers, how much longer than a lease's worst case to wait for the round
# to report a lost peer before the failure counts as this node's own.
MEMBERSHIP_NOTICE_MARGIN_S = 0.5


def local_fault(exitcodes: list[int]) -> bool:
    """A worker that died by a signal failed here; an exception may be a peer's doing."""
    return any(code < 0 for code in exitcodes)


class MembershipAwareAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that starts workers from warm spares and does not charge
    restarts for peers that left."""

    def __init__(
        self,
        *args: Any,
        warm_spares: bool = False,
        warm_imports: tuple[str, ...] = (),
        joined: threading.Event | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        # Set once this node's workers first ran in a round (the readiness probe reads it).
        self.joined = joined if joined is not None else threading.Event()
        # Workers (and the spares, which must see the same environment) learn here that
        # their round lost a peer: checkpoint.group_broken() then skips the SIGTERM grace.
        self._notes = Path(tempfile.mkdtemp(prefix="elasticjob-agent-"))
        self._group_broken = self._notes / "group-broken"
        os.environ[contract.GROUP_BROKEN_FILE] = str(self._group_broken)
        # Each round's assignment per local rank, and the workers' answers (channel.py).
        self._channel = AgentChannel(self._notes)
        os.environ[contract.AGENT_CHANNEL] = str(self._notes)
        self._generation = 0
        self._next_start = StartKind()
        self._spares: SparePool | None = None
        self._joined_once = False
        spec = self._worker_group.spec
        if warm_spares and isinstance(spec.entrypoint, str):
            target = parse_worker_command(
                spec.entrypoint, [str(a) for a in spec.args], sys.executable
            )
            if target is None:
                log.info("warm spares off: the worker command is not `python [-u] [-m] target`")
            else:
                self._spares = SparePool(target, spec.local_world_size, warm_imports=warm_imports)
                self._spares.fill()  # they warm up while the first rendezvous runs

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
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
        super()._rendezvous(worker_group)

    def run(self, role: str = "default") -> Any:
        try:
            return super().run(role)
        finally:
            if self._spares is not None:
                self._spares.close()
            shutil.rmtree(self._notes, ignore_errors=True)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch's loop sets the state before it calls this: HEALTHY is its membership
        # branch (a peer left or came); FAILED/UNHEALTHY means a local worker exited.
        if worker_group.state == WorkerState.HEALTHY and self._workers_regroup_in_place():
            self._regroup_in_place(worker_group)
            return
        super()._restart_workers(worker_group)

    def _workers_regroup_in_place(self) -> bool:
        """Every local worker runs the training-loop API and is the process it said it was."""
        if self._pcontext is None:
            return False
        pids = self._pcontext.pids()
        offered = self._channel.in_place_pids()
        return bool(pids) and all(offered.get(rank) == pid for rank, pid in pids.items())

    def _regroup_in_place(self, worker_group: WorkerGroup) -> None:
        """The next round for the running workers: rendezvous, then hand each its new
        rank and world through the channel; no process stops or starts."""
        handler = worker_group.spec.rdzv_handler
        lost = handler.peers_lost() if isinstance(handler, EtcdV3RendezvousHandler) else []
        log.info(
            "regrouping the running workers in place%s",
            f" (the round lost {lost}: they abandon its collectives)" if lost else "",
        )
        self._next_start = StartKind(in_place=True, abort=bool(lost))
        try:
            self._initialize_workers(worker_group)
        finally:
            self._next_start = StartKind()

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        if isinstance(handler, EtcdV3RendezvousHandler):
            lost = handler.peers_lost()
            if lost:
                log.info("the round lost %s: workers save their last step without waiting", lost)
                self._group_broken.touch()
        self._channel.forget_workers()
        super()._stop_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._group_broken.unlink(missing_ok=True)
        self._generation += 1
        generation, kind, running = self._generation, self._next_start, self._pcontext
        spares = self._spares

        def start(**kwargs: Any) -> PContext:
            self._channel.deliver(generation, kwargs["envs"], kind.abort)
            if kind.in_place and running is not None:
                return running
            if spares is not None:
                return start_processes_warm(spares, **kwargs)
            return original(**kwargs)

        with starting_workers_with(start) as original:
            started: dict[int, Any] = super()._start_workers(worker_group)
        self.joined.set()
        return started

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        handler = worker_group.spec.rdzv_handler
        if result.state == WorkerState.HEALTHY:
            if self._channel.regroup_requested(self._generation) and (
                self._workers_regroup_in_place()
            ):
                # A collective failed with no membership change (yet): a new round for
                # everyone; the other agents see this node waiting and follow.
                log.info("a worker's collective failed; opening the next round")
                self._regroup_in_place(worker_group)
            return result
        if result.state not in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            return result
        if not isinstance(handler, EtcdV3RendezvousHandler):
            return result
        if local_fault([failure.exitcode for failure in result.failures.values()]):
            return result
        # A dead peer's key outlives it by up to notice_within(ttl); the margin is for a
        # busy etcd and the watch that tells us.
        reason = handler.wait_for_membership_change(
            notice_within(handler.lease_ttl) + MEMBERSHIP_NOTICE_MARGIN_S
        )
        if reason is None:
            return result
        log.info("workers failed because the group changed (%s); not counted as a restart", reason)
        # HEALTHY sends torch's loop to its membership branch: num_nodes_waiting() > 0,
        # so it restarts the workers into the next round without spending a restart.
        return RunResult(state=WorkerState.HEALTHY)


@dataclass(frozen=True)
class StartKind:
    """How the next round reaches this node's workers."""

    in_place: bool = False  # the running workers regroup; nothing is started
    abort: bool = False  # the round they leave lost a peer


@contextlib.contextmanager
def starting_workers_with(start: Callable[..., PContext]) -> Iterator[Callable[..., PContext]]:
    """While torch's agent starts a round's workers, it calls ``start`` instead of its
    ``start_processes`` (given back, for ``start`` to fall through to)."""
    original: Callable[..., PContext] = vars(local_elastic_agent)["start_processes"]
    setattr(local_elastic_agent, "start_processes", start)  # noqa: B010
    try:
        yield original
    finally:
        setattr(local_elastic_agent, "start_processes", original)  # noqa: B010
