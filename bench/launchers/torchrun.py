"""torchrun: torch's own elastic launcher, on its c10d rendezvous (or on our etcd backend)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.launchers import scripts
from bench.launchers.api import NodeCommand, Workload
from bench.ports import free_port

if TYPE_CHECKING:
    from bench.harness import Job

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# each workload as a user writes it for torchrun: the plain original where it was converted
PLAIN: dict[Workload, Path] = {
    Workload.REGRESSION: scripts.REGRESSION,
    Workload.GPT: scripts.GPT_PLAIN,
    Workload.GPT_FSDP: scripts.GPT_FSDP_PLAIN,
    Workload.CLASSIC: scripts.CLASSIC,
}


def elastic_argv(prefix: list[str], backend: str, job: Job) -> list[str]:
    """torchrun's command line (ours takes the same flags): one process per node."""
    return [
        *prefix,
        f"--nnodes={job.nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={job.rdzv_endpoint}",
        f"--rdzv-id={job.run_id}",
        "--local-addr=127.0.0.1",
        f"--max-restarts={job.max_restarts}",
        str(job.script),
        *job.train_args,
    ]


def needs_etcd(launcher: str, etcd: str | None) -> str:
    """The bench's etcd, for a launcher whose nodes meet there."""
    if etcd is None:
        raise ValueError(f"{launcher} needs the bench's etcd")
    return etcd


@dataclass(frozen=True)
class Torchrun:
    """torchrun as its docs run it; ``backend`` c10d (the first node hosts a TCPStore) or
    etcd-v3 (our rendezvous backend under torch's agent)."""

    backend: str = "c10d"

    @property
    def name(self) -> str:
        return f"torchrun-{self.backend}"

    def script(self, workload: Workload) -> Path | None:
        return PLAIN[workload]

    def endpoint(self, etcd: str | None) -> str:
        if self.backend == "c10d":
            return f"127.0.0.1:{free_port()}"
        return needs_etcd(self.name, etcd)

    def start(self, job: Job) -> None:
        return None

    def node(self, job: Job, index: int) -> NodeCommand:
        return NodeCommand(elastic_argv(TORCHRUN, self.backend, job))

    def first_node_hosts(self) -> bool:
        return self.backend == "c10d"
