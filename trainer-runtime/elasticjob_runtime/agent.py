"""torch's ``LocalElasticAgent``, told apart a broken group from a local fault.

When a peer node dies, the workers here usually fail too (gloo reports the closed
connection) before the peer's lease runs out. Stock torch charges that to this
node's ``--max-restarts``, so a long job on preemptible nodes runs out of restarts
although nothing here ever failed. This agent gives the etcd-v3 rendezvous one
lease TTL to explain a failure: if a peer left or a new round opened meanwhile,
the failure is reported as a membership change, which restarts the workers into
the next round without spending a restart. A worker killed by a signal here
(SIGKILL, the OOM killer, a segfault) is a local fault and is charged at once.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elasticjob_runtime.rendezvous import EtcdV3RendezvousHandler

log = logging.getLogger(__name__)


def local_fault(exitcodes: list[int]) -> bool:
    """A worker that died by a signal failed here; an exception may be a peer's doing."""
    return any(code < 0 for code in exitcodes)


class MembershipAwareAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that does not charge restarts for peers that left."""

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
