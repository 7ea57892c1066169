"""The bench's torchft launcher still starts: a lighthouse and two replica groups in a
network namespace of their own train the realistic script together, and every committed
step's samples read back (bench/coverage.py). The race itself is `make bench`'s."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from bench.coverage import trained
from bench.harness import Job, start_agents, wait_for
from bench.launchers import LAUNCHERS, Workload

pytestmark = [pytest.mark.integration]

# the realistic script, small: a step in milliseconds
ARGS = [
    "--steps=1000",
    "--samples=64",
    "--batch-size=4",
    "--accumulate=2",
    "--workers=0",
    "--dim=16",
    "--layers=1",
    "--heads=2",
    "--seq=8",
    "--vocab=32",
    "--log-every=1",
    "--log-samples=1",
    "--sleep=0.05",
]


@pytest.mark.skipif(
    shutil.which("ip") is None, reason="needs iproute2 (ip netns) for its namespace"
)
def test_two_torchft_replica_groups_train_the_realistic_script_in_one_quorum(
    tmp_path: Path,
) -> None:
    launcher = LAUNCHERS["torchft-hb1000ms"]
    script = launcher.script(Workload.GPT)
    assert script is not None
    job = Job(
        launcher.name,
        tmp_path,
        launcher.endpoint(None),
        "2:2",
        ARGS,
        f"smoke-{uuid.uuid4().hex[:8]}",
        script=script,
    )
    try:
        start_agents(job, 2)
        wait_for(
            "both replica groups at step 5 in a quorum of 2",
            lambda: [s for s in job.steps() if s.step >= 5 and s.world == 2] or None,
            timeout=60,
        )
        logs = job.logs()
    finally:
        job.stop()
    indices = trained(logs)
    assert len(indices) >= 5 * 2 * 8  # 5 steps, 2 groups, 2 micro-batches of 4
    assert set(indices) <= set(range(64))
