"""torchft: Meta's fault-tolerant training, the peer that recovers in place as we do.

Run as its README and its torchx launcher run it: a lighthouse
(``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``),
and per node one replica group, its own ``torchrun --nnodes=1`` with
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` and
``--max-restarts``, so a killed worker is restarted by its torchrun and heals from a live
group. The lighthouse's heartbeat timeout is its default (5 s) unless ``heartbeat_ms``
says otherwise (the tuned variant: 1 s).

torchft's manager listens on every interface (``[::]``, not configurable in 0.2.0), and so
do torchrun's store and gloo: each job runs inside a network namespace the bench creates
(``ip netns``) with only its loopback up, and removes when the job stops. The lighthouse
binds that namespace's 127.0.0.1; gloo is pinned to ``lo``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.launchers import scripts
from bench.launchers.api import NodeCommand, Workload
from bench.launchers.namespace import in_namespace, start_service

if TYPE_CHECKING:
    from bench.harness import Job

LIGHTHOUSE_PORT = 29510  # inside the job's own namespace: nothing else binds there
GROUP_STORE_PORT = 29600  # + the node's index: each replica group's torchrun store
WRITTEN_FOR_TORCHFT: dict[Workload, Path] = {
    Workload.REGRESSION: scripts.REGRESSION_TORCHFT,
    Workload.GPT: scripts.GPT_TORCHFT,
}


def lighthouse_command(heartbeat_ms: int | None) -> list[str]:
    """The README's lighthouse, bound to the namespace's loopback."""
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    argv = [
        str(binary),
        "--min_replicas=1",
        "--quorum_tick_ms=100",
        "--join_timeout_ms=10000",
        f"--bind=127.0.0.1:{LIGHTHOUSE_PORT}",
    ]
    return argv if heartbeat_ms is None else [*argv, f"--heartbeat_timeout_ms={heartbeat_ms}"]


def most_nodes(nnodes: str) -> int:
    """``2:3`` -> 3: torchft's sampler shards over the most replica groups a job may have."""
    return int(nnodes.rsplit(":", 1)[-1])


@dataclass(frozen=True)
class Torchft:
    heartbeat_ms: int | None = None  # the lighthouse's heartbeat timeout; None: its default

    @property
    def name(self) -> str:
        return "torchft" if self.heartbeat_ms is None else f"torchft-hb{self.heartbeat_ms}ms"

    def script(self, workload: Workload) -> Path | None:
        return WRITTEN_FOR_TORCHFT.get(workload)

    def endpoint(self, etcd: str | None) -> str:
        return f"http://127.0.0.1:{LIGHTHOUSE_PORT}"

    def start(self, job: Job) -> None:
        """The job's namespace (loopback up) and its lighthouse, both undone by job.stop."""
        start_service(job, lighthouse_command(self.heartbeat_ms), job.workdir / "lighthouse.log")

    def node(self, job: Job, index: int) -> NodeCommand:
        argv = in_namespace(
            job,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={GROUP_STORE_PORT + index}",
                f"--max-restarts={job.max_restarts}",
                f"--rdzv-id={job.run_id}",  # the bench finds stray workers by it
                str(job.script),
                *job.train_args,
            ],
        )
        env = {
            "REPLICA_GROUP_ID": str(index),
            "NUM_REPLICA_GROUPS": str(most_nodes(job.nnodes)),
            "TORCHFT_LIGHTHOUSE": job.rdzv_endpoint,
            "GLOO_SOCKET_IFNAME": "lo",
        }
        return NodeCommand(argv, env)

    def first_node_hosts(self) -> bool:
        return False
