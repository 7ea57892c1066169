"""Two agents of one run, one training process each, every worker's output kept per
node: what the tests of a peer that freezes, hangs or dies mid-regroup start, and how
they read the workers' steps back."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from conftest import EtcdServer, start


def steps_of(text: str) -> list[tuple[int, int, int]]:
    """(step, world size, pid) of every step line, in order."""
    return [
        (int(s), int(w), int(p))
        for s, w, p in re.findall(r"^step=(\d+) .* world=(\d+) .* pid=(\d+) ", text, re.M)
    ]


def workers_of(tmp_path: Path, node: str) -> str:
    """Everything node ``node``'s workers printed, every round's."""
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob(f"logs-{node}/**/stdout.log")))


def start_two_nodes(
    agents: list[subprocess.Popen[bytes]],
    etcd: EtcdServer,
    tmp_path: Path,
    run_id: str,
    script: list[str],
    *,
    steps: int,
    sleep: float,
    max_restarts: int,
    flags: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """Nodes a and b (``flags``: each node's own launcher flags), nproc 1, training
    ``script`` for ``steps`` steps with every rank logging every step; their agents and
    their logs, a's first."""
    procs, logs = [], []
    for node in "ab":
        log = tmp_path / f"agent-{node}.log"
        args = [
            f"--steps={steps}",
            "--epochs=100",
            "--log-every=1",
            "--log-ranks=all",
            f"--sleep={sleep}",
            "--checkpoint-interval=10",
            f"--checkpoint-dir={tmp_path / f'ckpt-{node}'}",
        ]
        own = (flags or {}).get(node, ())
        procs.append(
            start(
                agents,
                etcd,
                log,
                [*script, *args],
                nnodes="2",
                nproc=1,
                max_restarts=max_restarts,
                run_id=run_id,
                launcher_flags=(*own, "--redirects=3", f"--log-dir={tmp_path / f'logs-{node}'}"),
                env={"ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp_path / f"shm-{node}")},
            )
        )
        logs.append(log)
    return procs, logs
