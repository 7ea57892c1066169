"""A worker that dies leaves nothing behind: the processes it forked (DataLoader workers,
helpers of the script) hold copies of its sockets, so while they live its peers see no
connection reset, and a helper that never checks its parent would live for ever. The
agent kills the dead worker's session at once (torch's signals only live workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, start, still_running, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_dead_workers_children_are_killed_with_it_and_training_goes_on(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    orphans = tmp_path / "children"
    orphans.mkdir()
    run_id = f"orphan-{uuid.uuid4().hex[:8]}"
    script = [
        str(WORKERS / "orphan_child.py"),
        "--steps=60",
        "--log-every=1",
        "--sleep=0.05",
        "--checkpoint-interval=10",
        f"--checkpoint-dir={tmp_path / 'ckpt'}",
    ]
    env = {
        "CRASH_AT_STEP": "20",
        "ORPHAN_DIR": str(orphans),
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp_path / "shm"),
    }
    procs = [
        start(
            agents,
            etcd,
            tmp_path / f"agent-{n}.log",
            script,
            nnodes="2",
            nproc=1,
            max_restarts=1,
            run_id=run_id,
            env=env,
        )
        for n in "ab"
    ]
    log = tmp_path / "agent-a.log"

    def child_of_the_dead() -> int | None:
        """The child of the worker that died (its pid file names a gone process)."""
        for path in orphans.iterdir():
            if not still_running([int(path.name)]):
                return int(path.read_text())
        return None

    try:
        child = wait_for("rank 1 to die at step 20", child_of_the_dead, 180, log)
        # Generous bound: the agent notices within its monitor interval; without the rule the
        # child sleeps its 600 s.
        gone = lambda: True if not still_running([child]) else None  # noqa: E731
        wait_for("its child to be gone", gone, 30, log)
        for proc in procs:
            wait_for("the job to finish", lambda p=proc: p.poll(), 300, log)
            assert proc.returncode == 0, log.read_text()[-3000:]
        assert len(list(orphans.iterdir())) == 3  # 2 workers, 1 restarted after the kill
    except BaseException:
        for agent_log in sorted(tmp_path.glob("agent-*.log")):  # wait_for shows a's alone
            print(f"--- {agent_log.name}\n{agent_log.read_text()[-4000:]}")
        raise
    finally:  # the children still alive (those of workers that succeeded are not the rule's)
        for pid in still_running(int(p.read_text()) for p in orphans.iterdir()):
            os.kill(pid, signal.SIGKILL)
