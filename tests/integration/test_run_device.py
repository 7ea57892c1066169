"""The device a plain ``python train.py`` Run picks (device_choice.py), end to end: the
process's own CUDA view, ``ELASTICJOB_DEVICE``, and the error for a GPU that is not there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

SCRIPT = """
from elasticjob_runtime.training.run import Run
run = Run(checkpoint_dir={ckpt!r})
print("device", run.device, flush=True)
run.finish()
"""


def run_device(tmp_path: Path, asked: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ELASTICJOB_DEVICE"}
    if asked is not None:
        env["ELASTICJOB_DEVICE"] = asked
    code = SCRIPT.format(ckpt=str(tmp_path / "ckpt"))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_run_trains_on_its_local_ranks_gpu_or_the_cpu_and_says_which(tmp_path: Path) -> None:
    out = run_device(tmp_path, None)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert f"device {expected}" in out.stdout
    out = run_device(tmp_path, "cpu")
    assert out.returncode == 0 and "device cpu" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to give")
def test_asking_for_a_gpu_where_there_is_none_stops_with_what_to_do(tmp_path: Path) -> None:
    out = run_device(tmp_path, "cuda")
    assert out.returncode != 0
    assert "ELASTICJOB_DEVICE='cuda' asks for a GPU, but this process sees none" in out.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
