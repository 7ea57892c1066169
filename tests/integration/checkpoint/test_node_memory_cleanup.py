"""A job's node-memory checkpoint copy goes when the job succeeds, and only then.

Outside a pod ``/dev/shm`` is the host's: a copy left there stays until a reboot. The
agent (``elasticjob-run``) removes its workers' copy once they have succeeded; a restart
must keep it (the restarted worker resumes from it) and so must a failure (the next
attempt resumes from it). Real agent, real etcd; the memory root is a temporary directory.

The test file doubles as the worker: ``python test_node_memory_cleanup.py <out> <mode>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EtcdServer, start, wait_for

pytestmark = pytest.mark.integration


def worker(out: str, mode: str) -> None:
    """First attempt: save step 3 (disk and node memory) and crash. The restart reports
    where it resumed from, then succeeds (``ok``) or fails again (``fail``)."""
    import torch

    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    work = Path(out)
    ckpt = CheckpointManager(work / "ckpt")
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    resumed = ckpt.load_latest()
    report = {
        "restart": restart,
        "memory_dir": str(ckpt.memory_dir),
        "resumed": None if resumed is None else str(resumed.path),
    }
    with (work / "report.jsonl").open("a") as f:
        f.write(json.dumps(report) + "\n")
    if restart == 0:
        ckpt.save({"w": torch.ones(4)}, 3)
    ckpt.close()
    if restart == 0 or mode == "fail":
        os._exit(1)


def run_job(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path, mode: str
) -> tuple[int, list[dict[str, Any]], str]:
    """The agent's exit code, its workers' reports and its log."""
    out = tmp / mode
    out.mkdir()
    log = out / "agent.log"
    proc = start(
        agents,
        etcd,
        log,
        [__file__, str(out), mode],
        nproc=1,
        max_restarts=1,
        launcher_flags=("--no-warm-spares",),
        env={"ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp / "shm")},
    )
    code = wait_for("the agent to exit", lambda: proc.poll(), 240, log)
    reports = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    return code, reports, log.read_text(errors="replace")


def test_a_job_that_succeeds_leaves_no_node_memory_copy_but_its_restart_read_it(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    (tmp_path / "shm").mkdir()
    code, reports, log = run_job(agents, etcd, tmp_path, "ok")
    assert code == 0, log[-3000:]
    memory = Path(reports[0]["memory_dir"])
    assert memory.is_relative_to(tmp_path / "shm" / "elasticjob")
    # the restart resumed from node memory: a restart keeps the copy
    assert [r["resumed"] for r in reports] == [None, str(memory / "step-0000000003.pt")]
    assert not memory.exists()
    assert not memory.parent.exists()  # the job's directory, empty now
    assert (tmp_path / "shm" / "elasticjob").is_dir()  # every job's root stays
    assert f"removed their node-memory checkpoint copy {memory}" in log


def test_a_job_that_fails_keeps_its_node_memory_copy_to_resume_from(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    (tmp_path / "shm").mkdir()
    code, reports, log = run_job(agents, etcd, tmp_path, "fail")
    assert code == 1, log[-3000:]
    memory = Path(reports[0]["memory_dir"])
    assert reports[1]["resumed"] == str(memory / "step-0000000003.pt")
    assert sorted(p.name for p in memory.iterdir()) == [
        "step-0000000003.pt",
        "step-0000000003.pt.commit",
    ]
    assert "node-memory checkpoint copy" not in log


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
