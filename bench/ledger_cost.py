"""Scenario ``ledger-cost``: what keeping the goodput ledger costs a training step.

Every rank keeps the run's goodput ledger (goodput/keeper.py, goodput/ledger.py). On the
training thread, every committed step calls ``LedgerKeeper.committed`` (a ``time.time``
and the pure ``ledger.committed``: a new frozen ``Ledger``), and each interval's save is
followed by ``LedgerKeeper.saved``; the reporter's ``update`` then only keeps a reference
to the ledger. Rank 0's publisher thread (etcd/progress.py), not the step, encodes it
(``ledger.encode``) with each progress record, at most once a ``min_interval`` (1 s), and
``LedgerKey`` puts it as JSON under a key of its own every ``LEDGER_EVERY_S`` (5 s).

Timed where they are paid, in one spawned process: a gloo group of one on loopback, no
launcher, the regression step :mod:`bench.check_cost` times
(examples/train_regression.py's ``make_model``, Adam, batch 32, under a ``Run`` with
``in_place=False``). After a warm-up, :data:`STEPS` timed steps (no save among them,
no agreement check), each step's ``committed`` timed inside it (the Run's own keeper,
swapped for one that times each call: the cost in a real step, caches and all); then,
back to back, ``committed`` and ``saved`` on a copy of that keeper, and ``encode`` and
the JSON of a ledger with every field set (every cause paused, a recovery ended).

The figure is the training thread's ledger per step, ``committed`` in the step plus
``saved`` over :data:`CHECKPOINT_INTERVAL` steps (``bench.run``'s interval; the example's
default is 50), against the step: the step is the example's compute alone (``bench.run``
adds ``--sleep=0.05`` after each, and runs 2 ranks, whose all-reduce is longer), so the
share is an upper bound. The publisher's encoding is per second, beside it. Medians
(two cores shared with other work: the median is what a step pays).
"""

from __future__ import annotations

import inspect
import itertools
import json
import multiprocessing
import queue
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.ports import free_port
from bench.report import Figure
from bench.spawned_ranks import as_rank, stop_spawned

SCENARIO = "ledger-cost"
CASE = "train_regression"
TARGET = 0.5  # percent of a step (issue 38)
WARMUP, STEPS = 20, 300
CHECKPOINT_INTERVAL = 20  # bench.run's TRAIN_ARGS: a save (and a ``saved``) every 20 steps
CALLS, BATCHES = 200, 25  # back-to-back timings: batches of calls, the median batch's mean


@dataclass
class Sample:
    """One repetition, in seconds (medians)."""

    step: float  # a training step under the Run, the ledger's commit inside it
    committed: float  # LedgerKeeper.committed in those steps
    committed_loop: float  # the same, back to back
    saved: float  # LedgerKeeper.saved, back to back
    encode: float  # ledger.encode of a ledger with every field set
    dumps: float  # json.dumps(..., sort_keys=True) of that encoded ledger
    publish_every: float  # the reporter's min_interval: an encode at most this often
    key_every: float  # LEDGER_EVERY_S: the ledger key's JSON this often


def per_step(s: Sample, interval: int = CHECKPOINT_INTERVAL) -> float:
    """Percent of a step the training thread spends on the ledger: ``committed`` each
    step, ``saved`` once every ``interval`` steps."""
    if interval < 1 or s.step <= 0:
        raise ValueError(f"need interval >= 1 and step > 0 (got {interval}, {s.step})")
    return 100.0 * (s.committed + s.saved / interval) / s.step


def publisher_per_second(s: Sample) -> float:
    """Seconds per second the publisher thread spends on the ledger: an encode and its
    JSON in each record, one more JSON for the ledger key."""
    return (s.encode + s.dumps) / s.publish_every + s.dumps / s.key_every


def publish_intervals() -> tuple[float, float]:
    """(the reporter's default ``min_interval``, ``LEDGER_EVERY_S``): the runtime's own."""
    from elasticjob_runtime.etcd import progress

    default = inspect.signature(progress.reporter_from_env).parameters["min_interval"].default
    return float(default), float(progress.LEDGER_EVERY_S)


# ---------------------------------------------------------------- in the process


def _per_call(call: Callable[[], object]) -> float:
    """Seconds per call back to back: the median over :data:`BATCHES` of :data:`CALLS`."""
    means = []
    for _ in range(BATCHES):
        began = time.perf_counter()
        for _ in range(CALLS):
            call()
        means.append((time.perf_counter() - began) / CALLS)
    return statistics.median(means)


def _worker(port: int, directory: str, results: Any) -> None:
    """Train the timed steps under a Run, then time the ledger's calls; put a Sample."""
    as_rank(0, 1, port)
    import torch

    from bench.check_cost import _build  # the regression step check-cost times
    from elasticjob_runtime import Run
    from elasticjob_runtime.goodput import ledger as gl
    from elasticjob_runtime.goodput.keeper import LedgerKeeper

    class TimedKeeper(LedgerKeeper):
        """The Run's keeper, timing each commit."""

        def __init__(self, ledger: gl.Ledger) -> None:
            super().__init__(ledger)
            self.times: list[tuple[int, float]] = []

        def committed(self, step: int) -> None:
            began = time.perf_counter()
            super().committed(step)
            self.times.append((step, time.perf_counter() - began))

    torch.set_num_threads(1)
    run = Run(
        checkpoint_dir=Path(directory) / "rank0",
        checkpoint_interval=10**9,  # no save among the timed steps
        in_place=False,
        seed=0,
        check_every=0,  # no agreement check among them
    )
    batches, body = _build(CASE, run)
    keeper = run._goodput = TimedKeeper(run._goodput.ledger)
    times: list[float] = []
    done = False
    for _ in run.epochs(10**6, max_steps=WARMUP + STEPS):
        last = time.perf_counter()
        for batch in batches():
            with run.step():
                body(batch)
            now = time.perf_counter()
            if run.global_step > WARMUP:
                times.append(now - last)
            last = now
            if run.global_step >= WARMUP + STEPS:
                done = True
                break
        if done:
            break
    in_step = [dt for step, dt in keeper.times if step > WARMUP]

    loop = LedgerKeeper(keeper.ledger)
    steps = itertools.count(keeper.ledger.step + 1)
    committed_loop = _per_call(lambda: loop.committed(next(steps)))
    saved = _per_call(loop.saved)
    full = keeper.ledger
    for cause in gl.Cause:  # every field set: the largest record the publisher encodes
        full = gl.interrupted(full, cause, time.time())
        full = gl.paused(full, time.time())
        full = gl.committed(full, full.step + 1, time.time())
    encode = _per_call(lambda: gl.encode(full))
    doc = gl.encode(full)
    dumps = _per_call(lambda: json.dumps(doc, sort_keys=True))
    publish_every, key_every = publish_intervals()
    found = Sample(
        step=statistics.median(times),
        committed=statistics.median(in_step),
        committed_loop=committed_loop,
        saved=saved,
        encode=encode,
        dumps=dumps,
        publish_every=publish_every,
        key_every=key_every,
    )
    run.finish()
    results.put(asdict(found))


# ---------------------------------------------------------------- the driver


def measure_once(timeout: float, parent: Path | None = None) -> Sample:
    """One repetition: a spawned process, killed if it overruns ``timeout``."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    directory = Path(tempfile.mkdtemp(prefix="ledger-cost-", dir=parent))
    proc = ctx.Process(target=_worker, args=(free_port(), str(directory), results), daemon=True)
    try:
        proc.start()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{CASE}: no result within {timeout:.0f} s")
            try:
                return Sample(**results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"{CASE}: the process exited {proc.exitcode}") from None
    finally:
        stop_spawned([proc], results, directory)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.3g} us"


def figures(samples: Sequence[Sample], failures: Sequence[str]) -> list[Figure]:
    """The training thread's ledger in percent of a step (held to :data:`TARGET`), and
    the publisher's in microseconds of CPU per second."""
    mid = {
        name: statistics.median(getattr(s, name) for s in samples) if samples else None
        for name in ("step", "committed", "committed_loop", "saved", "encode", "dumps")
    }
    share = [per_step(s) for s in samples]
    publisher = [publisher_per_second(s) * 1e6 for s in samples]
    every = f"{samples[0].publish_every:g} s" if samples else "-"
    key = f"{samples[0].key_every:g} s" if samples else "-"
    step_ms = "-" if mid["step"] is None else f"{mid['step'] * 1000:.3g} ms"
    note = (
        f"step {step_ms}; committed {_us(mid['committed'])} in the step "
        f"({_us(mid['committed_loop'])} back to back), saved {_us(mid['saved'])} every "
        f"{CHECKPOINT_INTERVAL} steps; encode {_us(mid['encode'])} and its JSON "
        f"{_us(mid['dumps'])} per record (every {every}), the ledger key's JSON every {key}; "
        "medians"
    )
    med = statistics.median(share) if share else None
    return [
        Figure(
            SCENARIO,
            CASE,
            f"ledger on the training thread (committed each step, saved every "
            f"{CHECKPOINT_INTERVAL}), per step",
            "%",
            ours=[round(v, 4) for v in share],
            target=f"< {TARGET:g} %",
            met=None if med is None else med < TARGET,
            failures=list(failures),
            note=note,
        ),
        Figure(
            SCENARIO,
            CASE,
            "ledger encoded by the publisher thread (not in the step), per second",
            "us/s",
            ours=[round(v, 2) for v in publisher],
            failures=list(failures),
            note=note,
        ),
    ]


def run(reps: int, parent: Path | None = None, timeout: float = 120.0) -> list[Figure]:
    """``reps`` repetitions, for ``bench.run``."""
    samples: list[Sample] = []
    failures: list[str] = []
    for _ in range(reps):
        try:
            s = measure_once(timeout, parent)
        except (TimeoutError, RuntimeError) as exc:
            failures.append(str(exc))
            print(f"{SCENARIO:<12} {CASE:<17} FAILED: {exc}", flush=True)
            continue
        samples.append(s)
        shown = (
            f"{per_step(s):.3f} % of a step (step {s.step * 1000:.2f} ms, committed "
            f"{_us(s.committed)}, saved {_us(s.saved)}); publisher "
            f"{publisher_per_second(s) * 1e6:.1f} us/s"
        )
        print(f"{SCENARIO:<12} {CASE:<17} {shown}", flush=True)
    return figures(samples, failures)
