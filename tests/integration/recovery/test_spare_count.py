"""Fewer warm spares than local ranks (``ELASTICJOB_WARM_SPARE_COUNT``): each spare is a
process with torch imported, so a node may keep fewer. Real agent, real etcd, real torch
workers over gloo: the lowest ranks start from the spares, the others cold, a restart
likewise, and only that many idle spares wait beside the workers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, start, wait_for

from elasticjob_devcluster.procs import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# "starting fresh world=2 rank=1 restarts=0 startup=... start=cold t=..."
START = re.compile(
    r"^(?:starting fresh|resumed from step) .*rank=(\d+) restarts=(\d+) .*start=(\w+)"
)


def test_one_spare_for_two_ranks_starts_rank_0_warm_and_rank_1_cold(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    proc = start(
        agents,
        etcd,
        log,
        [
            str(WORKERS / "crash_once.py"),
            "--steps=150",
            "--sleep=0.05",
            "--checkpoint-interval=10",
            "--log-ranks=all",
            f"--checkpoint-dir={tmp_path / 'ckpt'}",
        ],
        max_restarts=1,
        env={
            "CRASH_AT_STEP": "25",
            "ELASTICJOB_WARM_SPARE_COUNT": "1",
            "ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp_path / "shm"),
        },
    )
    wait_for("the restart", lambda: "restarts=1" in log.read_text() or None, 180, log)
    # beside the two workers, one idle spare (the one that became rank 0 was replaced,
    # forked from the template, which is the fourth)
    family = wait_for(
        "the workers, their replacement spare and the template",
        lambda: found if len(found := descendants(proc.pid)) >= 4 else None,
        60,
        log,
    )
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in family]
    spares = [c for c in cmdlines if b"elasticjob_runtime.launch.spare" in c]
    assert len(spares) == 2 and sum(b"--template" in c for c in spares) == 1, cmdlines
    assert sum(b"crash_once.py" in c for c in cmdlines) == 2, cmdlines

    assert wait_for("the job to finish", lambda: proc.poll(), 240, log) == 0
    starts = sorted(m.groups() for line in log.read_text().splitlines() if (m := START.match(line)))
    assert starts == [
        ("0", "0", "warm"),
        ("0", "1", "warm"),
        ("1", "0", "cold"),
        ("1", "1", "cold"),
    ]
