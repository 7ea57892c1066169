"""Scenario ``sharded-stall``: how long a sharded (DCP) save stops the training thread.

Two gloo processes each hold half of a model's and its Adam moments' rows as DTensors
(``--size`` in all, like bench/checkpoint_stall.py's sizes). Each repetition, in a fresh
directory on the disk of ``--dir``: ``dcp.save`` of the state (what a script written for
torchrun does: every rank writes its part and waits for the rest), then
``ShardedCheckpoints.save`` of the same state (what ``run.shard`` does: the shards
copied to CPU and planned on the training thread, written in a thread), and its
``close`` (the background write and the commit, which training does not wait for); each
twice, the second measured (from its second save on, ours copies into the first one's
buffers, as in a training loop). The order alternates between repetitions. The figure
is rank 0's training-thread stall, ours beside ``dcp.save``; the background write's own
seconds go in the note, since on cores that training already fills, that work still
competes with it.

``python -m bench.sharded_stall --sizes 100MB 1GB --reps 3``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.checkpoint_stall import parse_size, size_label
from bench.ports import free_port
from bench.report import Figure, markdown_table

SCENARIO = "sharded-stall"
BASELINE = "dcp.save (every rank waits for its write)"
TARGET = 0.25  # blocked <= a quarter of dcp.save's time
COLS = 1024


@dataclass(frozen=True)
class Sample:
    """One repetition on rank 0, in seconds."""

    dcp_save: float  # dcp.save, start to return
    blocked: float  # ShardedCheckpoints.save, start to return
    background: float  # its close(): the rest of the write and the commit


def rows_for(nbytes: int, cols: int = COLS) -> int:
    """Rows of a float32 (rows, cols) tensor that, with Adam's two moments beside it
    (three tensors in all), make about ``nbytes`` (at least one row per rank)."""
    return max(2, round(nbytes / (3 * 4 * cols)))


def figure(size: str, samples: Sequence[Sample]) -> Figure:
    """Ours blocked beside dcp.save, medians, with the background seconds in the note."""
    ours = [s.blocked for s in samples]
    base = [s.dcp_save for s in samples]
    ratio = statistics.median(ours) / statistics.median(base)
    return Figure(
        scenario=SCENARIO,
        case=f"{size_label(size)} sharded over 2 ranks (model + Adam moments)",
        metric="training thread blocked by a save, rank 0",
        unit="s",
        ours=ours,
        baseline=base,
        baseline_name=BASELINE,
        target=f"ours/baseline <= {TARGET}",
        met=ratio <= TARGET,
        note=(
            "the background write and commit took "
            f"{statistics.median(s.background for s in samples):.2f} s (median), on the "
            "same cores"
        ),
    )


def _rank(rank: int, port: int, rows: int, directory: str, ours_first: bool, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticjob_runtime.checkpoints.format import serialize
    from elasticjob_runtime.checkpoints.sharded import ShardedCheckpoints

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    whole = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(0))
    state = {
        "model": {"w": distribute_tensor(whole, mesh, [Shard(0)])},
        "optim": {
            "w": {
                "exp_avg": distribute_tensor(whole * 0.1, mesh, [Shard(0)]),
                "exp_avg_sq": distribute_tensor(whole * whole, mesh, [Shard(0)]),
            }
        },
    }
    ours = ShardedCheckpoints(Path(directory) / "ours", keep=1)

    def dcp_save(step: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        save(state, checkpoint_id=Path(directory) / f"dcp-{step}")
        return time.perf_counter() - started

    def ours_save(step: int) -> tuple[float, float]:
        dist.barrier()
        started = time.perf_counter()
        ours.save(step, state, serialize({"step": step}))
        returned = time.perf_counter()
        ours.close()
        return returned - started, time.perf_counter() - returned

    # each saves twice, and the second is measured: a training loop saves again and
    # again, and from the second save on ours copies into the first one's buffers
    for step in (1, 2):
        if ours_first:
            blocked, background = ours_save(step)
            synchronous = dcp_save(step)
        else:
            synchronous = dcp_save(step)
            blocked, background = ours_save(step)
    out.put((rank, Sample(synchronous, blocked, background)))
    dist.destroy_process_group()


def repetition(nbytes: int, parent: Path | None, rep: int) -> Sample:
    """One repetition (two processes) in a fresh directory under ``parent``."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    directory = tempfile.mkdtemp(prefix="sharded-stall-", dir=parent)
    try:
        port, rows = free_port(), rows_for(nbytes)
        procs = [
            ctx.Process(target=_rank, args=(r, port, rows, directory, rep % 2 == 1, out))
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        samples: dict[int, Sample] = dict(out.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
        return samples[0]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["100MB"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoints go")
    args = p.parse_args(argv)
    figures = [
        figure(size, [repetition(parse_size(size), args.dir, rep) for rep in range(args.reps)])
        for size in args.sizes
    ]
    print(markdown_table(figures))
    for fig in figures:
        print(f"{fig.case}: {fig.note}")


if __name__ == "__main__":
    main()
