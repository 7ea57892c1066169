"""Scenario ``checkpoint-stall``: how long a save stops the training thread, and restores.

A training loop that checkpoints stalls while the save runs on its thread. With
``CheckpointManager(async_save=True)`` only the snapshot (every tensor copied to CPU
buffers) runs there; serialising, hashing, writing and fsyncing run in the background.
The baseline is what a script without it does: ``torch.save`` of the same state to a file
in the same directory, ``fsync`` included, since the manager's write is durable too (it
fsyncs before its commit marker; without the fsync the baseline would only fill the page
cache, and a crash could lose the checkpoint it reports as saved).

The state is a real ``nn.Module`` (a stack of ``Linear`` layers) with Adam's state after
one step, sized so model + optimizer bytes reach the requested size. Each repetition
runs in fresh temporary directories (the checkpoint directory on the disk of ``--dir``,
node memory on ``/dev/shm``), removed afterwards: two async saves with a training step
between them, and ``torch.save`` before or after them (alternating). The second async save
is the figure: a training loop saves periodically, and from its second save on the
manager reuses the first one's CPU buffers (the note keeps the first save's stall, and one
``memmove`` of the same bytes, the floor of any copy at that moment). Then a fresh
manager, as in a restarted worker, restores from node memory, and one without node memory
restores from the disk, with the file's pages first dropped from the page cache
(``posix_fadvise``), so that the disk is read.

``python -m bench.checkpoint_stall --sizes 100MB 1GB --reps 3`` prints the table and
writes ``bench/results/checkpoint_stall.json`` and ``.md`` (:mod:`bench.report`).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.report import Figure, markdown_table, write

if TYPE_CHECKING:
    import torch

SCENARIO = "checkpoint-stall"
BASELINE = "torch.save (synchronous)"
STALL_TARGET = 0.05  # blocked <= 5 % of the synchronous save (issue 12, scenario 4)
WIDTH = 1024  # Linear(WIDTH, WIDTH) layers: 4 MiB of weights each, 12 MiB with Adam
RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_stall.json"
# unit as written, upper-cased -> (its usual spelling, bytes)
_UNITS = {
    u.upper(): (u, n)
    for u, n in [
        *[("B", 1), ("KB", 10**3), ("MB", 10**6), ("GB", 10**9)],
        *[("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)],
    ]
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*$", re.IGNORECASE)


# ---------------------------------------------------------------- pure


def parse_size(text: str) -> int:
    """Bytes in ``"100MB"``, ``"1GB"``, ``"1.5 GiB"`` (MB and GB decimal, as disks count)."""
    number, (_, scale) = _split(text)
    nbytes = int(float(number) * scale)
    if nbytes <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return nbytes


def size_label(text: str) -> str:
    """The case name a size is reported under: ``"100MB"`` -> ``"100 MB"``."""
    number, (unit, _) = _split(text)
    return f"{number} {unit}"


def _split(text: str) -> tuple[str, tuple[str, int]]:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (say e.g. 100MB, 1GB, 512MiB)")
    return match.group(1), _UNITS[match.group(2).upper()]


def layers_for(nbytes: int, width: int = WIDTH) -> int:
    """How many ``Linear(width, width)`` layers make ``nbytes`` of float32 weights, biases
    and Adam's two moments (3 x 4 bytes per parameter), at least one."""
    per_layer = 3 * 4 * (width * width + width)
    return max(1, round(nbytes / per_layer))


@dataclass(frozen=True)
class Sample:
    """One repetition's timings, seconds."""

    baseline_s: float  # torch.save + fsync, on the caller's thread
    first_blocked_s: float  # the manager's first async save: CPU buffers allocated
    blocked_s: float  # its second async save: the training thread's stall
    memcpy_s: float  # one memmove of as many bytes between warm buffers: any copy's floor
    durable_s: float  # the second save, from the call until disk and node memory hold it
    restore_memory_s: float  # restore() from node memory into the live model + optimizer
    restore_disk_s: float  # the same from the disk, its pages dropped from the page cache
    load1: float  # 1-minute load average when the repetition ended
    state_bytes: int  # model + optimizer tensors saved


@dataclass
class Case:
    """One size's repetitions: the samples of those that finished, why the others did not."""

    size: str  # as asked, e.g. "1GB"
    samples: list[Sample]
    failures: list[str]


def figures(case: Case) -> list[Figure]:
    """The scenario's two figures for one size: the stall (target: <= 5 % of the
    baseline, met by the medians) and the restore (node memory beside the disk, no target)."""
    samples, failures, label = case.samples, case.failures, size_label(case.size)
    stall = Figure(
        scenario=SCENARIO,
        case=label,
        metric="training thread blocked by a save",
        unit="s",
        ours=[s.blocked_s for s in samples],
        baseline=[s.baseline_s for s in samples],
        baseline_name=BASELINE,
        target=f"<= {STALL_TARGET * 100:.0f} % of baseline",
        failures=list(failures),
        note=_note(parse_size(case.size), samples),
    )
    o, b = stall.ours_median, stall.baseline_median
    stall.met = None if o is None or b is None else o <= STALL_TARGET * b
    restore = Figure(
        scenario=SCENARIO,
        case=label,
        metric="restore (node memory vs disk)",
        unit="s",
        ours=[s.restore_memory_s for s in samples],
        baseline=[s.restore_disk_s for s in samples],
        baseline_name="the same restore from disk (page cache dropped)",
        failures=list(failures),
    )
    return [stall, restore]


def _note(asked: int, samples: Sequence[Sample]) -> str:
    nbytes = samples[0].state_bytes if samples else asked
    if not samples:
        return f"{nbytes / 1e6:.0f} MB of model + Adam state"

    def med(values: list[float]) -> float:
        return statistics.median(values)

    loads = [s.load1 for s in samples]
    return (
        f"{nbytes / 1e6:.0f} MB of model + Adam state; first save (buffers allocated) "
        f"{med([s.first_blocked_s for s in samples]):.3f} s; one memmove of the same bytes "
        f"{med([s.memcpy_s for s in samples]):.3f} s; save durable (disk + node "
        f"memory) after {med([s.durable_s for s in samples]):.2f} s; "
        f"load {min(loads):.1f}-{max(loads):.1f}"
    )


# ---------------------------------------------------------------- measuring


def build_state(
    nbytes: int, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A model and its Adam optimizer on ``device``, one step taken (so the moments
    exist), and the bytes of both state dicts' tensors."""
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers_for(nbytes))]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_step(model, opt)
    return model, opt, state_bytes({"model": model.state_dict(), "optim": opt.state_dict()})


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch

    device = next(model.parameters()).device
    loss = model(torch.randn(4, WIDTH, device=device)).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # gradients are not saved: do not hold their memory


def state_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def sync_torch_save(state: dict[str, Any], path: Path) -> float:
    """Seconds for ``torch.save`` to ``path`` and its fsync, as a plain script saves."""
    import torch

    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({k: v.state_dict() for k, v in state.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def memcpy_seconds(nbytes: int) -> float:
    """Seconds for one memmove of ``nbytes`` between two buffers already faulted in: what
    copying the state costs at best right now (memory bandwidth, the CPU we get)."""
    import ctypes

    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    started = time.perf_counter()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    return time.perf_counter() - started


def drop_cached(directory: Path) -> None:
    """Evict the (fsynced, so clean) checkpoint files' pages from the page cache, so a
    restore reads the disk; only these files, not the whole machine's cache."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def repetition(nbytes: int, parent: Path | None, rep: int) -> Sample:
    """One repetition in fresh temp directories (removed at the end)."""
    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    model, opt, actual = build_state(nbytes)
    state: dict[str, Any] = {"model": model, "optim": opt}
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    work = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=parent))
    memory = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=shm_root))
    try:
        kw: dict[str, Any] = dict(writer=True, memory_writer=True, job="bench", keep=1)
        mgr = CheckpointManager(work / "ckpt", async_save=True, memory_dir=memory, **kw)
        baseline_first = rep % 2 == 1  # alternate, so neither always meets the other's writeback
        baseline = sync_torch_save(state, work / "plain.pt") if baseline_first else 0.0
        started = time.perf_counter()
        mgr.save(state, 1)
        first = time.perf_counter() - started
        mgr.wait()
        train_step(model, opt)
        started = time.perf_counter()
        mgr.save(state, 2)
        blocked = time.perf_counter() - started
        mgr.wait()
        durable = time.perf_counter() - started
        memcpy = memcpy_seconds(actual)
        mgr.close()
        del mgr  # its CPU buffers: a restarted worker has none
        if not baseline_first:
            baseline = sync_torch_save(state, work / "plain.pt")
        (work / "plain.pt").unlink()

        started = time.perf_counter()
        from_memory = CheckpointManager(work / "ckpt", memory_dir=memory, **kw).restore(
            state, sync=False
        )
        restore_memory = time.perf_counter() - started
        assert from_memory is not None and from_memory.path.parent == memory, from_memory
        del from_memory
        drop_cached(work / "ckpt")
        started = time.perf_counter()
        from_disk = CheckpointManager(work / "ckpt", memory=False, **kw).restore(state, sync=False)
        restore_disk = time.perf_counter() - started
        assert from_disk is not None and from_disk.path.parent == work / "ckpt", from_disk
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return Sample(
        baseline_s=baseline,
        first_blocked_s=first,
        blocked_s=blocked,
        memcpy_s=memcpy,
        durable_s=durable,
        restore_memory_s=restore_memory,
        restore_disk_s=restore_disk,
        load1=os.getloadavg()[0],
        state_bytes=actual,
    )


def measure(sizes: Sequence[str], reps: int, parent: Path | None = None) -> list[Case]:
    """Every size, ``reps`` repetitions each; a repetition that fails is recorded, not fatal."""
    cases: list[Case] = []
    for text in sizes:
        case = Case(text, [], [])
        for rep in range(reps):
            try:
                case.samples.append(repetition(parse_size(text), parent, rep))
            except (OSError, MemoryError, RuntimeError, AssertionError) as exc:
                case.failures.append(f"repetition {rep}: {type(exc).__name__}: {exc}")
        cases.append(case)
    return cases


def run(sizes: Sequence[str], reps: int, parent: Path | None = None) -> list[Figure]:
    """Two figures per size (see :func:`figures`), for ``bench.run``."""
    return [f for case in measure(sizes, reps, parent) for f in figures(case)]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.checkpoint_stall", description=__doc__.split("\n")[0]
    )
    p.add_argument("--sizes", nargs="+", default=["100MB", "1GB"], help="model + optimizer state")
    p.add_argument("--reps", type=int, default=3, help="repetitions per size")
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoint directories go")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON (.md beside it)")
    args = p.parse_args(argv)
    for text in args.sizes:
        parse_size(text)  # a typo fails before minutes of measuring
    load_before = os.getloadavg()
    started = time.time()
    cases = measure(args.sizes, args.reps, args.dir)
    found = [f for case in cases for f in figures(case)]
    import torch

    extra = {
        "command": "python -m bench.checkpoint_stall " + " ".join(argv or sys.argv[1:]),
        "started": started,
        "seconds": round(time.time() - started, 1),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "checkpoint_dir_parent": str(args.dir or tempfile.gettempdir()),
        "samples": {c.size: [asdict(s) for s in c.samples] for c in cases},
    }
    write(found, args.out, extra)
    print(markdown_table(found))
    for f in found:
        if f.note:
            print(f"{f.case}: {f.note}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
