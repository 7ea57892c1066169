"""What a plain ``python train.py`` Run picks when the script does not say, end to end:
its device (device_choice.py: the process's own CUDA view, ``ELASTICJOB_DEVICE``, the
error for a GPU that is not there) and its checkpoint directory (the manifest's
``ELASTICJOB_CHECKPOINT_DIR``)."""

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
run = Run({args})
print("device", run.device, flush=True)
print("checkpoints", run.ckpt.directory, flush=True)
run.finish()
"""


def plain_run(
    tmp_path: Path, env: dict[str, str], args: str = ""
) -> subprocess.CompletedProcess[str]:
    drop = ("ELASTICJOB_DEVICE", "ELASTICJOB_CHECKPOINT_DIR")
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    code = SCRIPT.format(args=args)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def run_device(tmp_path: Path, asked: str | None) -> subprocess.CompletedProcess[str]:
    env = {"ELASTICJOB_DEVICE": asked} if asked is not None else {}
    return plain_run(tmp_path, env, f"checkpoint_dir={str(tmp_path / 'ckpt')!r}")


def test_a_run_checkpoints_where_the_manifest_says_without_being_told(tmp_path: Path) -> None:
    out = plain_run(tmp_path, {"ELASTICJOB_CHECKPOINT_DIR": str(tmp_path / "volume")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"checkpoints {tmp_path / 'volume'}" in out.stdout


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


MISUSED_LOADER = """
from elasticjob_runtime.training.run import Run
run = Run(checkpoint_dir={ckpt!r})
try:
    run.loader(list(range(8)), 2, seed=1)
except TypeError as exc:
    print("said:", exc, flush=True)
try:
    run.loader(list(range(8)), 2)
except RuntimeError as exc:
    print("said:", exc, flush=True)
run.finish()
"""


def test_a_loader_misused_says_in_one_line_what_to_do(tmp_path: Path) -> None:
    code = MISUSED_LOADER.format(ckpt=str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stdout.splitlines() if line.startswith("said: ")]
    assert said == [
        "said: run.loader() takes no seed=: each sample is read under a seed from "
        "Run(seed=...), the epoch and its index",
        "said: call run.wrap(...) or run.shard(...) before run.loader()",
    ], out.stdout
