"""`python -m bench.save_cost`: the CPU of one interval save of the realistic example's
state, part by part, with torch's zip CRC-32 computed and left out.

An asynchronous save (``checkpoints/manager.py``) takes a CPU copy of the state on the
training thread, then a writer thread serialises it into the first copy's file, hashing
it on the way (``checkpoints/files.py``, ``commit``), and the second copy is a kernel
copy of the first. On a node whose cores the ranks fill, every CPU-millisecond of the
writer is one the training loses (bench/README.md, the goodput breakdown). This times
each part on the same 53 MB, alternating the two ways ``torch.save`` runs, with
``--busy`` processes computing beside it; CPU is the calling thread's own, so what the
kernel does for a write or a ``sendfile`` is in it and a wait for the disk is not.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import side_load
from bench.gpt_state import realistic_state
from bench.report import write_probe


class _Discard:
    """A sink that keeps nothing: ``torch.save`` alone."""

    def write(self, data: bytes | memoryview) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def cpu_ms(part: Callable[[], object]) -> float:
    """The calling thread's CPU for ``part``, in ms."""
    start = time.thread_time()
    part()
    return (time.thread_time() - start) * 1000


def plain_save(state: Any, sink: Any) -> None:
    """``torch.save`` as torch's defaults run it (the zip's CRC-32 computed)."""
    import torch

    torch.save(dict(state), sink)


def parts(reps: int, memory_root: Path, disk_root: Path) -> dict[str, list[float]]:
    """Each part's CPU ms per repetition, both ways of serialising alternating."""
    import torch

    from elasticjob_runtime.checkpoints import files
    from elasticjob_runtime.checkpoints.format import serialize_into, state_to_save
    from elasticjob_runtime.checkpoints.snapshot import Snapshots

    live = realistic_state(trained=True)
    snapshots = Snapshots()
    snap: dict[str, Any] = {}

    def take() -> None:
        snap.update(snapshots.take(state_to_save(live)))

    take()
    data = io.BytesIO()
    serialize_into(snap, data)
    raw = data.getvalue()

    def runs(step: int) -> dict[str, Callable[[], object]]:
        """Each part of a save as step ``step`` (and ``step + 1``, the same state)."""
        ours = memory_root / files.checkpoint_name(step + 1)
        return {
            "snapshot (training thread)": take,
            "torch.save, zip CRC-32 computed": lambda: plain_save(snap, _Discard()),
            "torch.save, zip CRC-32 left out (ours)": lambda: serialize_into(snap, _Discard()),
            "SHA-256 of the bytes": lambda: hashlib.sha256(raw).digest(),
            "node-memory commit, CRC computed": lambda: files.commit(
                memory_root, step, lambda sink: plain_save(snap, sink)
            ),
            "node-memory commit (ours)": lambda: files.commit(
                memory_root, step + 1, lambda sink: serialize_into(snap, sink)
            ),
            "the second copy, by the kernel (sendfile, fsync)": lambda: files.commit(
                disk_root, step + 1, files.Written(ours, len(raw), "unchecked")
            ),
        }

    times: dict[str, list[float]] = {}
    for rep in range(reps):
        for name, part in runs(2 * rep + 1).items():
            times.setdefault(name, []).append(cpu_ms(part))
        files.prune(memory_root, 1)
        files.prune(disk_root, 1)
    assert torch.serialization.get_crc32_options()  # our saves put torch's default back
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.save_cost")
    p.add_argument("--reps", type=int, default=9, help="saves timed, each way")
    p.add_argument("--busy", type=int, default=2, help="processes computing beside it")
    p.add_argument("--disk", default=tempfile.gettempdir(), help="where the second copy goes")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    memory_root = Path(tempfile.mkdtemp(prefix="save-cost-", dir="/dev/shm"))
    disk_root = Path(tempfile.mkdtemp(prefix="save-cost-", dir=args.disk))
    try:
        with side_load.alongside([side_load.training_like(30 + 5 * args.reps)] * args.busy):
            times = parts(args.reps, memory_root, disk_root)
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    print(f"one save of the realistic state (53 MB), CPU ms, {args.reps} each:")
    for name, ms in times.items():
        ms = sorted(ms)
        print(f"  {name:42s} median {statistics.median(ms):6.1f} ({ms[0]:.1f}-{ms[-1]:.1f})")
    if args.out is not None:
        write_probe(args.out, args, {"cpu_ms": times})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
