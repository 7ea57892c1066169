"""Which job a worker belongs to, so that one job never restores another's checkpoint.

The identity keys the node-memory checkpoint directory and is recorded in every
checkpoint's commit marker; a node-memory checkpoint of another identity is refused.
It must be unique to the job and the same across the job's restarts:

* under the operator: namespace, job uid (``ELASTICJOB_JOB_UID``) and run id. A
  re-created job of the same name has a new uid; a resumed run a new run id.
* under torchrun (or ``elasticjob-run`` outside a pod): the run id and the rendezvous
  endpoint. Two agents with the same run id and endpoint join one rendezvous, so torchrun
  itself makes them one job; the run id alone is not enough, since torchrun's default is
  ``none`` for every job. torchrun does not pass its endpoint to workers, so it is read
  from the agent's command line (the worker's parent), else from ``PET_RDZV_ENDPOINT``.
  One etcd or store reached by two spellings (``localhost`` and ``127.0.0.1``) counts as
  two jobs: the safe side.
* a process no launcher started: its own process, so nothing is shared.

Pure but for :func:`current_job` and :func:`workers_job`, which read the environment and
``/proc``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from elasticjob_runtime import contract

_ENDPOINT_FLAGS = ("--rdzv-endpoint", "--rdzv_endpoint")


def run_id_of(env: Mapping[str, str]) -> str | None:
    """The run id torchrun gave the workers (``PET_RDZV_ID`` where only that is set)."""
    return env.get("TORCHELASTIC_RUN_ID") or env.get(contract.RDZV_ID) or None


def endpoint_from_argv(argv: Sequence[str]) -> str | None:
    """The ``--rdzv-endpoint`` of a torchrun-style command line (the first one given)."""
    for i, arg in enumerate(argv):
        for flag in _ENDPOINT_FLAGS:
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
    return None


def job_identity(
    env: Mapping[str, str], agent_argv: Sequence[str], run_id: str | None, pid: int
) -> str:
    """The job's identity (see the module docstring); ``pid`` names an unlaunched process."""
    run = run_id or run_id_of(env)
    uid = env.get(contract.JOB_UID)
    if uid:
        return f"k8s/{env.get(contract.JOB_NAMESPACE, '')}/{uid}/{run or 'none'}"
    if run is None:
        return f"process/{pid}"
    endpoint = endpoint_from_argv(agent_argv)
    if endpoint is None:
        endpoint = env.get(contract.RDZV_ENDPOINT, "")
    return f"torchrun/{run}@{endpoint}"


def directory_name(identity: str) -> str:
    """A file name for ``identity``: readable head, hash of the whole (so always unique)."""
    head = identity.split("/", 1)[-1].split("@", 1)[0]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", head)[:48]
    return f"{safe}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def command_line(pid: int) -> list[str]:
    """A process's command line, or [] if it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def agent_argv() -> list[str]:
    """The parent process's command line (torchrun's agent for a worker), or []."""
    return command_line(os.getppid())


def current_job(run_id: str | None = None) -> str:
    """This process's job identity."""
    return job_identity(os.environ, agent_argv(), run_id, os.getpid())


def workers_job(run_id: str) -> str:
    """In an agent: the identity its workers compute. They inherit its environment and read
    its command line as their parent's, so the agent finds their node-memory copy."""
    return job_identity(os.environ, command_line(os.getpid()), run_id, os.getpid())
