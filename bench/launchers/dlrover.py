"""DLRover: ``dlrover-run`` (DLRover 0.6.1) on the same unchanged scripts torchrun runs.

``dlrover-run --standalone`` does not start on torch 2.13: it launches its local master
through torch's ``SubprocessHandler`` with the arguments of an older torch, short of the
``numa_options`` that 2.11 and 2.13 both require (``TypeError: SubprocessHandler.__init__()
missing 1 required positional argument: 'numa_options'``), and standalone allows one node
only ("Only single node is supported in standalone mode."). So the bench runs DLRover as its
multi-node mode does: one job master of the kind ``--standalone`` would start (``python
-m dlrover.python.master.main --platform=local``, started first, as DLRover's operator
starts one per job in a cluster), and per node one ``dlrover-run --nnodes=...`` (the agent, its
rendezvous on the master: ``DLROVER_MASTER_ADDR``, ``NODE_RANK``/``NODE_ID`` the node's
index), with ``--max-restarts``; everything else at its defaults, so a rendezvous short of
the most nodes waits the master's 60 s last call for the rest (``lastcall_timeout``).

The master's gRPC server listens on every interface (``[::]``, not configurable in 0.6.1),
and so do the agent's store and gloo: as for torchft, each job runs inside a network
namespace of its own with only its loopback up, removed when the job stops.

DLRover is not one of the project's dependencies. It is run by the interpreter named by
``BENCH_DLROVER_PYTHON`` (default: the bench's own), which must import ``dlrover``; a
separate virtual environment that sees this one's packages (torch included) keeps its
dependencies out of the project's (:data:`INSTALL`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.launchers.api import NodeCommand, Workload
from bench.launchers.namespace import in_namespace, start_service
from bench.launchers.torchft import most_nodes
from bench.launchers.torchrun import PLAIN

if TYPE_CHECKING:
    from bench.harness import Job

MASTER_PORT = 29520  # inside the job's own namespace: nothing else binds there
PYTHON_ENV = "BENCH_DLROVER_PYTHON"  # the interpreter that runs DLRover (default: ours)
VERSION = "0.6.1"  # the one the bench was written against
VENV = "/tmp/dlrover-venv"  # where the install hint puts it
VENV_SITE = f"{VENV}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
INSTALL = f"""\
DLRover is not installed for {{python}}. Install it beside the project, not into its venv:
  {sys.executable} -m venv {VENV}
  {VENV}/bin/pip install --no-deps dlrover=={VERSION} psutil deprecated wrapt
  echo "import site; site.addsitedir('{{site}}')" > {VENV_SITE}/zz-project.pth
  export {PYTHON_ENV}={VENV}/bin/python
(--no-deps: dlrover[torch] would bring a torch of its own; the .pth lends it this venv's
torch, grpcio and protobuf)"""


def dlrover_python() -> str:
    return os.environ.get(PYTHON_ENV, sys.executable)


def has_dlrover(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("dlrover") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('dlrover') is None)"
    return subprocess.run([python, "-c", probe], check=False).returncode == 0


def require_dlrover() -> str:
    """The interpreter that runs DLRover, or a RuntimeError saying how to install it."""
    python = dlrover_python()
    if not has_dlrover(python):
        site = sysconfig.get_paths()["purelib"]
        raise RuntimeError(INSTALL.format(python=python, site=site))
    return python


def master_command(python: str, job: Job) -> list[str]:
    """The job master ``--standalone`` would start, for the most nodes the job may have."""
    return [
        python,
        "-u",
        "-m",
        "dlrover.python.master.main",
        f"--port={MASTER_PORT}",
        f"--node_num={most_nodes(job.nnodes)}",
        f"--job_name={job.run_id}",
        "--platform=local",
        "--xpu_type=cpu",
    ]


def events_dir(job: Job) -> str:
    """Where DLRover writes its event files (default ``/tmp/dlrover``): the job's own."""
    return str(job.workdir / "dlrover-events")


@dataclass(frozen=True)
class DlroverRun:
    @property
    def name(self) -> str:
        return "dlrover-run"

    def script(self, workload: Workload) -> Path | None:
        return PLAIN[workload]

    def endpoint(self, etcd: str | None) -> str:
        return f"127.0.0.1:{MASTER_PORT}"

    def start(self, job: Job) -> None:
        """The job's namespace (loopback up) and its master, both undone by job.stop."""
        start_service(
            job,
            master_command(require_dlrover(), job),
            job.workdir / "dlrover-master.log",
            {"DLROVER_EVENT_FILE_DIR": events_dir(job)},
        )

    def node(self, job: Job, index: int) -> NodeCommand:
        argv = in_namespace(
            job,
            [
                dlrover_python(),
                "-m",
                "dlrover.trainer.torch.main",  # dlrover-run's entry point
                f"--nnodes={job.nnodes}",
                "--nproc-per-node=1",
                f"--max-restarts={job.max_restarts}",
                str(job.script),
                *job.train_args,
            ],
        )
        env = {
            "DLROVER_MASTER_ADDR": job.rdzv_endpoint,
            "NODE_RANK": str(index),
            "NODE_ID": str(index),
            "NODE_NUM": str(most_nodes(job.nnodes)),
            # its run id, set as TORCHELASTIC_RUN_ID for the agent and its workers: the
            # bench finds stray workers by it
            "ELASTIC_JOB_NAME": job.run_id,
            "DLROVER_EVENT_FILE_DIR": events_dir(job),
            "GLOO_SOCKET_IFNAME": "lo",
        }
        return NodeCommand(argv, env)

    def first_node_hosts(self) -> bool:
        return False
