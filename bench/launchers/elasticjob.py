"""elasticjob-run: ours, on the bench's etcd; in place, or with in-place recovery off."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.launchers import scripts
from bench.launchers.api import NodeCommand, Workload
from bench.launchers.torchrun import elastic_argv, needs_etcd
from elasticjob_runtime import contract

if TYPE_CHECKING:
    from bench.harness import Job

ELASTICJOB_RUN = [sys.executable, "-m", "elasticjob_runtime.launch.launcher"]
CONVERTED: dict[Workload, Path] = {
    Workload.REGRESSION: scripts.REGRESSION,
    Workload.GPT: scripts.GPT_RUN,
    Workload.GPT_FSDP: scripts.GPT_FSDP_RUN,
    Workload.CLASSIC: scripts.CLASSIC,  # unchanged: the point of that workload
}


@dataclass(frozen=True)
class ElasticjobRun:
    """``in_place=False`` is the restart path: every worker restarts on a fault (from
    warm spares); ``fork_spares=False`` starts each spare as an interpreter of its own
    instead of forking it from the warm template (the cost a refill used to have);
    nothing else differs."""

    in_place: bool = True
    fork_spares: bool = True

    @property
    def name(self) -> str:
        base = "elasticjob-run" if self.in_place else "elasticjob-run-restart"
        return base if self.fork_spares else f"{base}-no-fork"

    def script(self, workload: Workload) -> Path | None:
        return CONVERTED[workload]

    def endpoint(self, etcd: str | None) -> str:
        return needs_etcd(self.name, etcd)

    def start(self, job: Job) -> None:
        return None

    def node(self, job: Job, index: int) -> NodeCommand:
        env = {} if self.in_place else {contract.IN_PLACE: "0"}
        if not self.fork_spares:
            env[contract.WARM_SPARE_FORK] = "0"
        return NodeCommand(elastic_argv(ELASTICJOB_RUN, "etcd-v3", job), env)

    def first_node_hosts(self) -> bool:
        return False
