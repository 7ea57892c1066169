"""``run.loader`` reads each round's first micro-batch in the training process while its
workers start (training/loader.py): the batches, each sample's random augmentation and the
training's own random draws are the same as with the reads all in workers or all in the
process, and only that one micro-batch is read here. A loader made before the model and
``wrap`` starts its workers at once and hands out the same batches. Each Run is a process
of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os, torch
from elasticjob_runtime import ElasticSampler, Run

class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 12
    def __getitem__(self, index):
        return index, float(torch.rand(1)), os.getpid()  # augmentation, and who read it

def children():
    with open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children") as f:
        return len(f.read().split())

run = Run(seed={seed}, checkpoint_dir={directory!r})
if {early}:  # before the model: the workers start now, forked from a small process
    loader = run.loader(Noisy(), 2, accumulate=2, num_workers={workers})
    print("WORKERS " + str(children()), flush=True)
model = torch.nn.Linear(1, 1)
run.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(12, seed=3))
if not {early}:
    loader = run.loader(Noisy(), 2, accumulate=2, num_workers={workers})
torch.manual_seed(5)
steps = []
for epoch in run.epochs(2):
    for micro_batches in loader:
        with run.step():
            draw = float(torch.rand(1))  # the training's own draw (dropout's stream)
            steps.append([
                [[int(i) for i in index], [round(float(n), 9) for n in noise],
                 [int(p) == os.getpid() for p in pid]]
                for index, noise, pid in micro_batches
            ] + [draw])
run.finish()
print("STEPS " + json.dumps(steps), flush=True)
"""


def steps_of(directory: Path, workers: int, seed: str, early: bool = False) -> list[Any]:
    """Each step of a fresh run (nothing to resume in ``directory``); ``early``: the
    loader is made before the model and ``wrap``."""
    script = SCRIPT.format(workers=workers, seed=seed, directory=str(directory), early=early)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "ELASTICJOB_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    if early:
        started = next(x for x in out.stdout.splitlines() if x.startswith("WORKERS "))
        assert started == f"WORKERS {workers}", out.stdout  # each a child of the trainer
    line = next(x for x in out.stdout.splitlines() if x.startswith("STEPS "))
    steps: list[Any] = json.loads(line.removeprefix("STEPS "))
    return steps


def without_readers(steps: list[Any]) -> list[Any]:
    """Each step's indices, noise and training draw, less who read its samples."""
    return [[[m[0], m[1]] for m in step[:-1]] + [step[-1]] for step in steps]


def test_the_first_micro_batch_of_a_round_is_read_here_and_nothing_else_changes(
    tmp_path: Path,
) -> None:
    in_workers = steps_of(tmp_path / "workers", workers=2, seed="0")
    in_process = steps_of(tmp_path / "process", workers=0, seed="0")
    assert len(in_workers) == 6  # 12 samples, 4 a step, 2 epochs
    assert without_readers(in_workers) == without_readers(in_process)
    for number, step in enumerate(in_workers):
        read_here = [all(m[2]) for m in step[:-1]]
        # each epoch is a round of the loader: its first micro-batch is read here
        assert read_here == ([True, False] if number % 3 == 0 else [False, False]), number
        assert not any(any(m[2]) for m in step[:-1]) or number % 3 == 0
    assert all(all(m[2]) for step in in_process for m in step[:-1])


def test_a_run_without_a_seed_keeps_its_draws_where_they_were(tmp_path: Path) -> None:
    """``seed=None`` re-seeds nothing at a step: the training's draws are one stream,
    which the in-process read (each item seeds the generators) must leave alone."""
    import torch

    steps = steps_of(tmp_path, workers=2, seed="None")
    expected = torch.rand(len(steps), generator=torch.Generator().manual_seed(5))
    assert [step[-1] for step in steps] == pytest.approx(expected.tolist())


@pytest.mark.parametrize("seed", ["0", "None"])
def test_a_loader_made_before_the_model_starts_its_workers_and_reads_the_same_batches(
    tmp_path: Path, seed: str
) -> None:
    """``seed=None``: the items are read under the sampler's seed, which the loader learns
    only at ``wrap``, after its workers were forked."""
    early = steps_of(tmp_path / "early", workers=2, seed=seed, early=True)
    late = steps_of(tmp_path / "late", workers=2, seed=seed)
    assert len(early) == 6
    assert early == late
