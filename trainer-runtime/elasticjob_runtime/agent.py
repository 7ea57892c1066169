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
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elasticjob_runtime import contract
from elasticjob_runtime.rendezvous import EtcdV3RendezvousHandler
from elasticjob_runtime.spare import parse_worker_command
from elasticjob_runtime.spare_pool import SparePool, workers_from

log = logging.getLogger(__name__)

# How long a new agent waits for its spares' imports before it joins a round anyway.
SPARES_WARM_TIMEOUT_S = 120.0


def local_fault(exitcodes: list[int]) -> bool:
    """A worker that died by a signal failed here; an exception may be a peer's doing."""
    return any(code < 0 for code in exitcodes)


class MembershipAwareAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that starts workers from warm spares and does not charge
    restarts for peers that left."""

    def __init__(
        self, *args: Any, warm_spares: bool = False, warm_imports: tuple[str, ...] = (), **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        # Workers (and the spares, which must see the same environment) learn here that
        # their round lost a peer: checkpoint.group_broken() then skips the SIGTERM grace.
        self._notes = Path(tempfile.mkdtemp(prefix="elasticjob-agent-"))
        self._group_broken = self._notes / "group-broken"
        os.environ[contract.GROUP_BROKEN_FILE] = str(self._group_broken)
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

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        if isinstance(handler, EtcdV3RendezvousHandler):
            lost = handler.peers_lost()
            if lost:
                log.info("the round lost %s: workers save their last step without waiting", lost)
                self._group_broken.touch()
        super()._stop_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._group_broken.unlink(missing_ok=True)
        if self._spares is None:
            return super()._start_workers(worker_group)  # type: ignore[no-any-return]
        with workers_from(self._spares):
            return super()._start_workers(worker_group)  # type: ignore[no-any-return]

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        handler = worker_group.spec.rdzv_handler
        if result.state not in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            return result
        if not isinstance(handler, EtcdV3RendezvousHandler):
            return result
        if local_fault([failure.exitcode for failure in result.failures.values()]):
            return result
        reason = handler.wait_for_membership_change(handler.lease_ttl + 0.5)
        if reason is None:
            return result
        log.info("workers failed because the group changed (%s); not counted as a restart", reason)
        # HEALTHY sends torch's loop to its membership branch: num_nodes_waiting() > 0,
        # so it restarts the workers into the next round without spending a restart.
        return RunResult(state=WorkerState.HEALTHY)
