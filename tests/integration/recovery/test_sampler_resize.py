"""Exact-once data across a resize, with real torch processes over gloo.

Half an epoch at world size 3, the processes stop (as when a node is lost), then
two new processes load the sampler state from the checkpoint and finish the
epoch. With ElasticSampler every index is seen exactly once; the same scenario
with torch's ElasticDistributedSampler repeats and skips samples, which is the
failure this sampler exists to avoid.

The test file doubles as the worker: ``python test_sampler_resize.py <args>``.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_all

pytestmark = pytest.mark.integration

N = 60  # dataset size
BATCH = 2  # per rank
HALF_STEPS = 5  # 5 steps x 3 ranks x 2 = 30 samples = half the epoch at world size 3
BOUND_S = 240.0


def worker(kind: str, workdir: str, rank: int, world: int, phase: int, max_steps: int) -> None:
    """One rank: read batches, all-reduce them (a real collective per step), record indices."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.utils.data import ElasticDistributedSampler
    from torch.utils.data import DataLoader, Sampler

    from elasticjob_runtime.checkpoints.manager import CheckpointManager
    from elasticjob_runtime.training.sampler import ElasticSampler

    work = Path(workdir)
    store = dist.FileStore(str(work / f"store-{phase}"), world)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dataset = torch.arange(N)
    ckpt = CheckpointManager(work / "ckpt", memory=False, writer=rank == 0)
    saved = ckpt.load_latest()
    consumed = int(saved.state["data"]["consumed"]) if saved is not None else 0
    sampler: Sampler[int]
    if kind == "elastic":
        ours = ElasticSampler(N, rank, world, seed=0)
        if saved is not None:
            ours.load_state_dict(saved.state["data"])
        ours.set_epoch(0)
        sampler = ours
    else:  # torch's: restarts the epoch from start_index = samples consumed so far
        theirs = ElasticDistributedSampler(
            dataset, num_replicas=world, rank=rank, start_index=consumed
        )
        theirs.set_epoch(0)
        sampler = theirs
    seen: list[int] = []
    for steps, batch in enumerate(DataLoader(dataset, batch_size=BATCH, sampler=sampler), 1):
        if steps > max_steps:
            break
        total = batch.sum()
        dist.all_reduce(total)  # keeps the ranks in lockstep like a DDP gradient sync
        seen.extend(int(i) for i in batch)
        consumed = min(N, consumed + world * BATCH)
        if isinstance(sampler, ElasticSampler):
            sampler.advance(world * BATCH)
            ckpt.save({"data": sampler}, phase * 1000 + steps)
        else:
            ckpt.save({"data": {"consumed": consumed}}, phase * 1000 + steps)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    (work / f"seen-{phase}-{rank}.json").write_text(json.dumps(seen))


def run_phase(work: Path, kind: str, world: int, phase: int, max_steps: int) -> None:
    env = {**os.environ, "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off", "GLOO_SOCKET_IFNAME": "lo"}
    run_all(
        [
            [sys.executable, __file__, kind, str(work), *map(str, (r, world, phase, max_steps))]
            for r in range(world)
        ],
        env,
        BOUND_S,
    )


def run_scenario(tmp_path: Path, kind: str) -> Counter[int]:
    """World size 3 for half the epoch, then world size 2 until the epoch ends."""
    run_phase(tmp_path, kind, 3, 1, HALF_STEPS)
    run_phase(tmp_path, kind, 2, 2, 10**6)
    seen: Counter[int] = Counter()
    for f in tmp_path.glob("seen-*.json"):
        seen.update(json.loads(f.read_text()))
    first_half = sum(len(json.loads((tmp_path / f"seen-1-{r}.json").read_text())) for r in range(3))
    assert first_half == 3 * BATCH * HALF_STEPS
    return seen


def test_elastic_sampler_sees_every_index_exactly_once_across_a_resize(tmp_path: Path) -> None:
    seen = run_scenario(tmp_path, "elastic")
    assert sorted(seen) == list(range(N))
    assert set(seen.values()) == {1}


def test_torch_elastic_distributed_sampler_repeats_and_skips_in_the_same_scenario(
    tmp_path: Path,
) -> None:
    seen = run_scenario(tmp_path, "torch")
    repeated = sorted(i for i, n in seen.items() if n > 1)
    skipped = sorted(set(range(N)) - set(seen))
    print(f"torch ElasticDistributedSampler: {len(repeated)} repeated, {len(skipped)} skipped")
    assert repeated, "expected torch's sampler to repeat samples after the resize"
    assert skipped, "expected torch's sampler to skip samples after the resize"


if __name__ == "__main__":
    kind, workdir, rank, world, phase, max_steps = sys.argv[1:7]
    worker(kind, workdir, int(rank), int(world), int(phase), int(max_steps))
