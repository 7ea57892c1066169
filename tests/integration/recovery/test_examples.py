"""The examples train under the real launcher against a real etcd.

The agents run the examples the way the manifests' pods do (``elasticjob-run ... -m
elasticjob_examples.<name>``) and are stopped by their recorded process groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESULT = "ELASTICJOB_RESULT "


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def launch(
    etcd: EtcdServer,
    run_id: str,
    nnodes: str,
    module: str,
    args: list[str],
    log: Path,
    checkpoints: Path,
) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env = {
        **clean,
        "PYTHONUNBUFFERED": "1",
        "ELASTICJOB_CHECKPOINT_DIR": str(checkpoints),
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off",
    }
    cmd = [
        sys.executable,
        "-m",
        "elasticjob_runtime.launch.launcher",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",
        "--max-restarts=1",
        "-m",
        module,
        *args,
    ]
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def finish(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> list[dict[str, Any]]:
    """Wait for the agents; return every result line they printed."""
    for proc, log in zip(procs, logs, strict=True):
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{log.name} still running after 300s:\n{log.read_text()[-3000:]}")
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-3000:]}"
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    return [
        json.loads(line[len(RESULT) :]) for line in text.splitlines() if line.startswith(RESULT)
    ]


def test_regression_example_trains_with_two_workers_and_the_loss_falls(
    etcd: EtcdServer, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    run_id = f"example-{uuid.uuid4().hex[:8]}"
    args = ["--steps=150", "--log-every=25", "--checkpoint-interval=50"]
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    for log in logs:
        agents.append(
            launch(
                etcd,
                run_id,
                "2:2",
                "elasticjob_examples.train_regression",
                args,
                log,
                tmp_path / "ckpt",
            )
        )
    results = finish(agents, logs)

    assert len(results) == 1, "exactly one rank 0 reports the result"
    result = results[0]
    assert result["world_size"] == 2
    assert result["steps"] == 150
    assert result["samples_seen"] == 150 * 2 * 32
    assert result["final_loss"] < 0.5 * result["initial_loss"], result
    text = logs[0].read_text() + logs[1].read_text()
    assert "step=150 " in text and "world=2 rank=0" in text
    assert (tmp_path / "ckpt" / "step-0000000150.pt.commit").exists()


def test_imagenet_example_runs_a_few_steps_on_synthetic_images(
    etcd: EtcdServer, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    log = tmp_path / "agent0.log"
    args = ["--max-steps=6", "--synthetic-size=256", "--print-freq=2", "--batch-size=16"]
    run_id = f"imagenet-{uuid.uuid4().hex[:8]}"
    agents.append(
        launch(etcd, run_id, "1", "elasticjob_examples.imagenet", args, log, tmp_path / "ckpt")
    )
    (result,) = finish(agents, [log])

    assert result["steps"] == 6
    assert result["samples_seen"] == 6 * 16
    assert 0.0 <= result["val_acc1"] <= 100.0
    assert "step=6 " in log.read_text()
    assert (tmp_path / "ckpt" / "step-0000000006.pt.commit").exists()
