"""Goodput under repeated faults: the share of wall time that turned into training steps.

Two agents (``--nnodes=2:2``) train; every ``interval`` seconds the worker process of an
agent drawn by a seeded random generator (the same draws for every launcher) is
SIGKILLed, for ``minutes``. Goodput = new steps in the window (redone steps do not
count: the newest step is what advanced) x the steady step time / the window's length.
The steady step is the median step of the window itself: faults touch a few dozen of its
hundreds of steps, and on a shared machine the speed drifts between the settling before
the first fault and the window (a run of 2026-11-28 measured 0.43 s a step before it and
0.37 s within, and reported 109.7 %); the figure measured before the first fault is kept
beside it (``step_time_before``); ``goodput_samples`` weighs each new step by the share
of the group that trained it. The step timeline is kept for the plot, and with the
scripts' ``--log-samples 1`` lines, how evenly the run trained its data
(:mod:`bench.coverage`).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from bench.coverage import Coverage, coverage, trained
from bench.harness import Job, StepLine, wait_for

AFTER_FAULT_S = 10.0  # how long after a fault slower steps are charged to it


@dataclass(frozen=True)
class LostTime:
    """Where a window's time went beyond its steady steps, in seconds: each gap between
    two new steps, less a steady step per step it advanced, charged to the first that
    applies."""

    pauses: float  # the gap a fault fell into
    checkpoints: float  # the gaps ending at an interval save's step and the next one
    after_faults: float  # the gaps within AFTER_FAULT_S of a fault (a spare starting)
    other: float  # the rest: noise, both ways
    # the part of ``pauses`` that was the step in flight at the kill, trained up to it
    # and dropped (at most a steady step): synchronous training loses it whatever the
    # recovery, so ``pauses - in_flight`` is the recovery's own time (0: older results)
    in_flight: float = 0.0


def lost_time(
    timeline: Sequence[tuple[float, int]],
    faults: Sequence[float],
    step_time: float,
    window: float,
    checkpoint_interval: int | None,
) -> LostTime:
    """The breakdown of a window [0, ``window``] from its (seconds, step) lines, any
    worker's, in any order; a step trained again after a fault is not new."""
    new: list[tuple[float, int]] = []
    for t, step in sorted(timeline):
        if not new or step > new[-1][1]:
            new.append((t, step))
    lost = dict.fromkeys(("pauses", "checkpoints", "after_faults", "other", "in_flight"), 0.0)
    for (t0, s0), (t1, s1) in pairwise(new):
        if t0 < 0 or t1 > window:  # a gap across the window's edge is left out
            continue
        excess = t1 - t0 - step_time * (s1 - s0)
        if kills := [f for f in faults if t0 <= f < t1]:
            lost["pauses"] += excess
            lost["in_flight"] += min(min(kills) - t0, step_time)
        elif checkpoint_interval and any(s % checkpoint_interval == 0 for s in (s1, s1 - 1)):
            lost["checkpoints"] += excess
        elif any(0 <= t0 - f < AFTER_FAULT_S for f in faults):
            lost["after_faults"] += excess
        else:
            lost["other"] += excess
    return LostTime(**{k: round(v, 2) for k, v in lost.items()})


@dataclass
class Goodput:
    launcher: str
    scenario: str = "goodput"  # or "gpt-goodput" (bench.real_scripts)
    window: float = 0.0
    steps: int = 0  # net new steps in the window
    step_time: float | None = None  # the window's median seconds per step
    step_time_before: float | None = None  # the same before the first fault
    goodput: float | None = None
    # the same, each new step counted by the share of the full group that trained it: a
    # peer whose survivors step on alone while a group restarts (torchft) trains a step on
    # part of the batch, and its sampler skips the rest
    goodput_samples: float | None = None
    faults: list[float] = field(default_factory=list)  # seconds into the window
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, step)
    lost: LostTime | None = None  # where the window's time went beyond the steady steps
    coverage: Coverage | None = None  # the data the whole run trained, from its first step
    error: str | None = None


def steady_step_time(
    steps: list[StepLine], until: float, since: float = float("-inf")
) -> float | None:
    """Median time between consecutive steps of one worker between ``since`` and
    ``until``."""
    gaps = [
        b.t - a.t
        for a, b in pairwise(s for s in steps if since <= s.t < until)
        if a.pid == b.pid and b.step == a.step + 1
    ]
    return statistics.median(gaps) if gaps else None


def goodput(steps: list[StepLine], start: float, end: float, step_time: float) -> tuple[int, float]:
    """(net new steps, goodput) of the window [start, end]."""
    at_start = max((s.step for s in steps if s.t <= start), default=0)
    at_end = max((s.step for s in steps if s.t <= end), default=at_start)
    gained = at_end - at_start
    return gained, round(gained * step_time / (end - start), 4)


def goodput_by_share(
    steps: list[StepLine], start: float, end: float, step_time: float, full: int
) -> float:
    """Goodput with each new step of the window weighed by ``world / full``: the share of
    the group (of ``full`` members) that trained it."""
    newest = max((s.step for s in steps if s.t <= start), default=0)
    trained = 0.0
    for s in sorted((s for s in steps if start < s.t <= end), key=lambda s: s.t):
        if s.step > newest:
            trained += (s.step - newest) * min(1.0, s.world / full)
            newest = s.step
    return round(trained * step_time / (end - start), 4)


def run_goodput(
    job: Job,
    minutes: float,
    interval: float,
    seed: int,
    scenario: str = "goodput",
    samples: int | None = None,
    checkpoint_interval: int | None = None,
) -> Goodput:
    """Inject the faults into ``job`` (already training steadily) and measure; with
    ``samples`` (the data set's size; the job logs its samples), the data it trained;
    with ``checkpoint_interval`` (the script's), the time its saves took apart."""
    result = Goodput(job.launcher, scenario)
    rng = random.Random(seed)
    start = time.time()
    end = start + minutes * 60
    faults: list[float] = []
    while (next_fault := start + interval * (len(faults) + 1)) < end:
        time.sleep(max(0.0, next_fault - time.time()))
        victim = job.agents[rng.randrange(len(job.agents))]
        pids = wait_for("a worker process to kill", victim.workers_or_none, 60)
        faults.append(time.time())
        for pid in pids:
            os.kill(pid, 9)
    time.sleep(max(0.0, end - time.time()))
    steps = job.steps()
    result.window = round(end - start, 1)
    result.faults = [round(f - start, 2) for f in faults]
    result.step_time = steady_step_time(steps, end, since=start)
    result.step_time_before = steady_step_time(steps, start)
    result.timeline = [(round(s.t - start, 3), s.step) for s in steps if start - 5 <= s.t <= end]
    if result.step_time is not None:
        result.steps, result.goodput = goodput(steps, start, end, result.step_time)
        full = max((s.world for s in steps if s.t <= start), default=1)
        result.goodput_samples = goodput_by_share(steps, start, end, result.step_time, full)
        result.lost = lost_time(
            result.timeline, result.faults, result.step_time, result.window, checkpoint_interval
        )
    # a script that logs no samples says nothing of its data
    if samples is not None and (indices := trained(job.logs())):
        result.coverage = coverage(indices, samples)
    return result
