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
            "both replica groups past step 5 in a quorum of 2",
            lambda: both if len(both := steppers(job, 5)) == 2 else None,
            timeout=60,
        )
        logs = job.logs()
    finally:
        job.stop()
    indices = trained(logs)
    # each group trained 2 micro-batches of 4 in every step it committed, at least the two
    # before step 5 (the second heals from the first, which may have stepped alone first)
    assert len(indices) >= 2 * 2 * 8 and len(indices) % 8 == 0, len(indices)
    assert set(indices) <= set(range(64))


def steppers(job: Job, step: int) -> set[int]:
    """The worker pids that logged a step past ``step`` in a quorum of 2."""
    return {s.pid for s in job.steps() if s.step > step and s.world == 2}
