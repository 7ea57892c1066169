"""The checkpoint stall with the state on a GPU: what users compare (DLRover's flash
checkpoint reports about 0.2 s of blocking).

The state is bench/checkpoint_stall.py's own (``build_state``: a stack of ``Linear``
layers and Adam, one step taken), built on ``cuda:0`` at each size. Per size, in one process:

* ``blocked_s``: how long ``CheckpointManager(async_save=True).save`` stops the training
  thread at its second save (the first allocates the pinned buffers it reuses): the
  device-to-host copy, all it waits for;
* the link's limit beside it: one ``copy_`` of the same bytes from one GPU tensor into
  pinned memory (``pinned_gbps``), and into ordinary pageable memory (``pageable_gbps``,
  what the copy ran at before it used pinned buffers);
* the baseline: a synchronous ``torch.save`` of the same state dicts, ``fsync`` included;
* ``durable_s`` (save to commit marker) and ``restore_s`` (a fresh manager loading the
  checkpoint from disk into the GPU state).

The target: ``blocked_s`` at most 0.2 s or the bytes over ``pinned_gbps``, the larger.

``python -m bench.gpu_stall --sizes 1GB 10GB --out stall.json`` (bench/gpu.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.checkpoint_stall import build_state, parse_size, sync_torch_save, train_step

TARGET_S = 0.2


def copy_gbps(nbytes: int, pinned: bool) -> float:
    """GB/s of one device-to-host copy of ``nbytes`` into a buffer already faulted in."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst.fill_(0)  # faulted in: the figure is the copy, not the kernel's page zeroing
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    started = time.perf_counter()
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / seconds / 1e9


def one_size(text: str, parent: Path | None, baseline: bool = True) -> dict[str, Any]:
    import torch

    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    nbytes = parse_size(text)
    row: dict[str, Any] = {"size": text}
    row["pinned_gbps"] = copy_gbps(nbytes, pinned=True)
    row["pageable_gbps"] = copy_gbps(nbytes, pinned=False)
    model, opt, actual = build_state(nbytes, torch.device("cuda", 0))
    torch.cuda.synchronize()  # the step's kernels are not the save's
    row["state_bytes"] = actual
    state: dict[str, Any] = {"model": model, "optim": opt}
    work = Path(tempfile.mkdtemp(prefix="gpu-stall-", dir=parent))
    try:
        mgr = CheckpointManager(work / "ckpt", async_save=True, memory=False, keep=1)
        started = time.perf_counter()
        mgr.save(state, 1)
        row["first_blocked_s"] = time.perf_counter() - started
        mgr.wait()
        train_step(model, opt)
        torch.cuda.synchronize()
        started = time.perf_counter()
        mgr.save(state, 2)
        row["blocked_s"] = time.perf_counter() - started
        print(json.dumps(row), flush=True)  # the figure, before the slow parts
        if not baseline:
            return {**row, "blocked_gbps": actual / row["blocked_s"] / 1e9}
        mgr.wait()
        row["durable_s"] = time.perf_counter() - started
        mgr.close()
        del mgr
        row["torch_save_s"] = sync_torch_save(state, work / "plain.pt")
        (work / "plain.pt").unlink()
        started = time.perf_counter()
        back = CheckpointManager(work / "ckpt", memory=False, keep=1).restore(state, sync=False)
        torch.cuda.synchronize()
        row["restore_s"] = time.perf_counter() - started
        assert back is not None and back.step == 2, back
    finally:
        shutil.rmtree(work, ignore_errors=True)
        del model, opt, state
        torch.cuda.empty_cache()
    row["blocked_gbps"] = actual / row["blocked_s"] / 1e9
    row["target_s"] = max(TARGET_S, actual / (row["pinned_gbps"] * 1e9))
    row["met"] = row["blocked_s"] <= row["target_s"]
    row["blocked_over_torch_save"] = row["blocked_s"] / row["torch_save_s"]
    return row


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_stall", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--sizes", nargs="+", default=["1GB", "10GB"])
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoints go")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--no-baseline", action="store_true", help="the stall alone: no torch.save, no restore"
    )
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for text in args.sizes:
        try:
            rows.append(one_size(text, args.dir, not args.no_baseline))
        except (OSError, RuntimeError, AssertionError, MemoryError) as exc:
            rows.append({"size": text, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        args.out.write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows[-1]), flush=True)
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    print(f"disk free after: {free / 1e9:.0f} GB, pid {os.getpid()}")


if __name__ == "__main__":
    main()
