"""What a plain ``python train.py`` Run picks when the script does not say, end to end:
its device (device_choice.py: the process's own CUDA view, ``ELASTICJOB_DEVICE``, the
error for a GPU that is not there), its checkpoint directory (the manifest's
``ELASTICJOB_CHECKPOINT_DIR``), the line a misused ``run.loader`` gives, and when its
process group is built (at wrap, or early with a warning for a ``torch.distributed`` call
before it). Each Run is a process of its own (a Run builds its process group), so the
cases share processes."""

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
try:
    run.loader(list(range(8)), 2, seed=1)
except TypeError as exc:
    print("said:", exc, flush=True)
loader = run.loader(list(range(8)), 2)  # before wrap: made, but not iterable yet
try:
    iter(loader)
except RuntimeError as exc:
    print("said:", exc, flush=True)
run.finish()
"""


GROUP_SCRIPT = """
import warnings
import torch
import torch.distributed as dist
from elasticjob_runtime import ElasticSampler, Run
warnings.simplefilter("always")
run = Run({args})
print("group before wrap", dist.is_initialized(), flush=True)
if {early}:
    print("rank asked early", dist.get_rank(), flush=True)
model = torch.nn.Linear(2, 2)
run.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(8, seed=0))
print("group after wrap", dist.is_initialized(), dist.get_rank(), flush=True)
run.finish()
"""


def plain_run(
    env: dict[str, str], args: str = "", script: str = SCRIPT, **more: object
) -> subprocess.CompletedProcess[str]:
    drop = ("ELASTICJOB_DEVICE", "ELASTICJOB_CHECKPOINT_DIR")
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    return subprocess.run(
        [sys.executable, "-c", script.format(args=args, **more)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_run_not_told_trains_on_its_gpu_and_checkpoints_where_the_manifest_says(
    tmp_path: Path,
) -> None:
    out = plain_run({"ELASTICJOB_CHECKPOINT_DIR": str(tmp_path / "volume")})
    assert out.returncode == 0, out.stderr[-3000:]
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert f"device {expected}" in out.stdout
    assert f"checkpoints {tmp_path / 'volume'}" in out.stdout
    # what the script says wins over the environment
    told = plain_run(
        {"ELASTICJOB_CHECKPOINT_DIR": str(tmp_path / "volume"), "ELASTICJOB_DEVICE": "cpu"},
        f"checkpoint_dir={str(tmp_path / 'mine')!r}",
    )
    assert told.returncode == 0, told.stderr[-3000:]
    assert "device cpu" in told.stdout and f"checkpoints {tmp_path / 'mine'}" in told.stdout


def test_a_loader_misused_says_in_one_line_what_to_do(tmp_path: Path) -> None:
    out = plain_run({}, f"checkpoint_dir={str(tmp_path / 'ckpt')!r}")
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stdout.splitlines() if line.startswith("said: ")]
    assert said == [
        "said: run.loader() takes no seed=: each sample is read under a seed from "
        "Run(seed=...), the epoch and its index",
        "said: the loader's batches come from the sampler given to run.wrap(...) or "
        "run.shard(...): call one of them before iterating the loader",
    ], out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to give")
def test_asking_for_a_gpu_where_there_is_none_stops_with_what_to_do(tmp_path: Path) -> None:
    out = plain_run({"ELASTICJOB_DEVICE": "cuda"}, f"checkpoint_dir={str(tmp_path / 'ckpt')!r}")
    assert out.returncode != 0
    assert "ELASTICJOB_DEVICE='cuda' asks for a GPU, but this process sees none" in out.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_the_group_is_built_at_wrap_and_a_collective_before_it_still_works(
    tmp_path: Path,
) -> None:
    """A joiner builds its model before its peers wait for it in the new group (run.py,
    ``_build_group``); a script that calls torch.distributed before wrap keeps working for
    a release, told why in a FutureWarning."""
    args = f"checkpoint_dir={str(tmp_path / 'ckpt')!r}"
    out = plain_run({}, args, GROUP_SCRIPT, early=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "group before wrap False" in out.stdout
    assert "group after wrap True 0" in out.stdout
    assert "FutureWarning" not in out.stderr
    early = plain_run({}, args, GROUP_SCRIPT, early=True)
    assert early.returncode == 0, early.stderr[-3000:]
    assert "rank asked early 0" in early.stdout and "group after wrap True 0" in early.stdout
    assert "FutureWarning: torch.distributed was called between Run() and run.wrap()" in (
        early.stderr
    )
