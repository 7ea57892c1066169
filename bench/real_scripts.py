"""The realistic script beside its plain-DDP original: what converting costs and buys.

examples/train_gpt.py (the training-loop API: ``Run``, ``run.wrap(...,
state={scheduler, scaler, ema})``, ``run.loader`` with 2 DataLoader worker processes and
2 micro-batches a step) runs under ``elasticjob-run``; bench/gpt_plain.py, the same model,
data, optimizer, schedule, accumulation, autocast, clipping and EMA written as people
write them for torchrun (``init_process_group``, ``DistributedSampler``, a ``DataLoader``
with 2 workers, its own ``torch.save``), runs under each torchrun launcher: the
comparison a user makes, their script under torchrun against the converted one under
ours. Same flags, same seed; only rank 0 logs ``step= ... samples= ... pid= t=``.

* ``gpt-throughput``: 2 agents, ``--nnodes=2:2``; samples per second from the step lines
  of steps :data:`WINDOW` (after warm-up, no checkpoint inside the window), ours and the
  baseline one after the other (the order alternates between repetitions).
* ``gpt-worker-kill``, ``gpt-scale-up``: ``bench.run``'s worker-kill and scale-up with
  these scripts (``--log-every=1``, a checkpoint every 20 steps).
* ``gpt-goodput`` (only when named): ``bench.run``'s goodput run with these scripts.
* ``check-cost``: :mod:`bench.check_cost`.
* ``ledger-cost``: :mod:`bench.ledger_cost`.

``--scenarios real-scripts`` runs the first three, check-cost and ledger-cost (about 12
minutes with ``--reps 3`` on 2 cores, so not in the default set).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from bench import groups
from bench.goodput import Goodput
from bench.harness import (
    Etcd,
    Job,
    Limits,
    start_agents,
    wait_for,
)
from bench.launchers import LAUNCHERS, Workload, scripts
from bench.report import Figure
from elasticjob_devcluster.procs import descendants

OURS = "elasticjob-run"
OURS_SCRIPT = scripts.GPT_RUN
PLAIN_SCRIPT = scripts.GPT_PLAIN
GROUP = "real-scripts"  # --scenarios real-scripts
SCENARIOS = (
    "gpt-throughput",
    "gpt-worker-kill",
    "gpt-scale-up",
    "gpt-goodput",
    "check-cost",
    "ledger-cost",
)
GROUP_SCENARIOS = ("gpt-throughput", "gpt-worker-kill", "gpt-scale-up", "check-cost", "ledger-cost")
FAULTS = {"gpt-worker-kill": "worker-kill", "gpt-scale-up": "scale-up"}  # -> bench.run's
WINDOW = (20, 120)  # steps whose samples/s is the throughput
THROUGHPUT_TARGET = 0.99  # ours / baseline
GOODPUT_TARGET = 0.99
# Both scripts' flags (examples/train_gpt.py parse_args); the model, data and batch are
# the scripts' defaults, spelled out so a change of default shows here.
COMMON = [
    "--epochs=1000",
    "--samples=4096",
    "--batch-size=8",
    "--accumulate=2",
    "--workers=2",
    "--threads=1",
    "--seed=0",
    "--log-every=1",
]
THROUGHPUT_ARGS = [
    *COMMON,
    f"--steps={WINDOW[1] + 20}",
    # no save inside the window: the figure is the training loop's (checkpoint-stall
    # measures the save)
    f"--checkpoint-interval={WINDOW[1] + 20}",
]
FAULT_ARGS = [*COMMON, "--steps=1000000", "--checkpoint-interval=20"]

_PROGRESS = re.compile(r"^step=(\d+) .*\bworld=(\d+) .*\bsamples=(\d+) pid=(\d+) t=([0-9.]+)\s*$")


def script_for(launcher: str) -> Path | None:
    """What a launcher runs: the converted script under ours, the plain one under torchrun,
    torchft's own shape under torchft, None where no script was written for it."""
    return LAUNCHERS[launcher].script(Workload.GPT)


def baseline_name(launcher: str) -> str:
    """What a baseline launcher ran, in words: its script and itself."""
    script = script_for(launcher)
    return f"{script.name if script else '-'}, {launcher}"


@dataclass(frozen=True)
class Steady:
    """One steady-state comparison: a converted script under ours beside its plain
    original under each other launcher, samples/s over the steps of ``window``."""

    scenario: str
    case: str  # the figure's case: which scripts
    script_for: Callable[[str], Path | None]
    args: tuple[str, ...]
    window: tuple[int, int]
    target: float  # ours / baseline at least
    baseline_name: Callable[[str], str]  # a baseline launcher -> what it ran, in words
    ours_args: tuple[str, ...] = ()  # added under our launchers only (a setting of the Run)


GPT_STEADY = Steady(
    "gpt-throughput",
    f"train_gpt.py vs the launcher's own script, steps {WINDOW[0]}-{WINDOW[1]}",
    script_for,
    tuple(THROUGHPUT_ARGS),
    WINDOW,
    THROUGHPUT_TARGET,
    baseline_name,
)


def expand(scenarios: Iterable[str]) -> list[str]:
    """``--scenarios`` with this group's name replaced by its scenarios."""
    return groups.expand(scenarios, GROUP, GROUP_SCENARIOS)


# ---------------------------------------------------------------- throughput (pure)


@dataclass(frozen=True)
class Progress:
    """A step line with the samples trained so far (all ranks together)."""

    step: int
    world: int
    samples: int
    pid: int
    t: float


def parse_progress(lines: Iterable[str]) -> list[Progress]:
    found = []
    for line in lines:
        m = _PROGRESS.match(line.strip())
        if m is not None:
            step, world, samples, pid = (int(m.group(i)) for i in range(1, 5))
            found.append(Progress(step, world, samples, pid, float(m.group(5))))
    return found


def window_rate(progress: Sequence[Progress], first: int, last: int) -> float | None:
    """Samples per second from the end of step ``first`` to the end of step ``last``, when
    one process logged both at one world size (no restart or resize in between)."""
    if last <= first:
        raise ValueError(f"the window must end after it starts ({first}, {last})")
    start = next((p for p in progress if p.step == first), None)
    end = next((p for p in progress if p.step == last), None)
    if start is None or end is None or (start.pid, start.world) != (end.pid, end.world):
        return None
    if end.t <= start.t or end.samples <= start.samples:
        return None
    return (end.samples - start.samples) / (end.t - start.t)


# ---------------------------------------------------------------- throughput (runs)


def median_gap(progress: Sequence[Progress], first: int, last: int) -> float | None:
    """Median seconds between consecutive logged steps of one process within the window:
    the typical step, less moved than the mean by a neighbour's burst on a shared host."""
    inside = sorted((p for p in progress if first <= p.step <= last), key=lambda p: p.t)
    gaps = [b.t - a.t for a, b in pairwise(inside) if (b.step, b.pid) == (a.step + 1, a.pid)]
    return statistics.median(gaps) if gaps else None


def role(cmdline: str, script: str) -> str:
    """What a process of a job is, from its command line: ``agent`` (which names the
    script too), ``spare`` (an idle warm spare), ``worker`` (runs the script) or ``other``
    (multiprocessing's helpers and the like). :func:`cpu_snapshot` calls a worker whose
    parent is a worker a ``loader`` (a forked DataLoader worker keeps the command line)."""
    if "elasticjob_runtime.launch.launcher" in cmdline or "torch.distributed.run" in cmdline:
        return "agent"
    if "elasticjob_runtime.launch.spare" in cmdline:
        return "spare"
    return "worker" if script in cmdline else "other"


def machine_cpu_times(stat: str | None = None) -> list[int] | None:
    """The machine's CPU time counters in ticks (``/proc/stat``'s ``cpu`` line: user, nice,
    system, idle, iowait, irq, softirq, steal, ...), None where there is none to read."""
    try:
        text = Path("/proc/stat").read_text() if stat is None else stat
    except OSError:
        return None
    first = text.splitlines()[0].split() if text else []
    if len(first) < 9 or first[0] != "cpu":
        return None
    return [int(v) for v in first[1:]]


def steal_percent(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the machine's CPU time between two readings that the hypervisor gave
    to others (``steal``): a shared host's load, which moves a run's step time without
    anything in the run changing. None without both readings or any time between."""
    if before is None or after is None:
        return None
    spent = [b - a for a, b in zip(before, after, strict=False)]
    total = sum(spent[:8])  # guest time is counted in user already
    return round(100 * spent[7] / total, 1) if total > 0 else None


def _cpu_seconds(pid: int) -> tuple[float, int] | None:
    """(user + system CPU seconds, parent pid) of a live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[1])


def cpu_snapshot(job: Job, etcd: Etcd | None) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of every process of ``job`` (and etcd)."""
    pids = [p for a in job.agents for p in (a.proc.pid, *descendants(a.proc.pid))]
    stats = {pid: found for pid in pids if (found := _cpu_seconds(pid)) is not None}
    roles: dict[int, str] = {}
    for pid in stats:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            roles[pid] = role(cmdline.decode(errors="replace"), job.script.name)
    out: dict[int, tuple[str, float]] = {}
    for pid, what in roles.items():
        cpu, parent = stats[pid]
        loader = what == "worker" and roles.get(parent) == "worker"
        out[pid] = ("loader" if loader else what, cpu)
    if etcd is not None and (found := _cpu_seconds(etcd.proc.pid)) is not None:
        out[etcd.proc.pid] = ("etcd", found[0])
    return out


def cpu_by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each role used between two snapshots (a process new in ``after``
    counts from zero; one gone from it is not counted)."""
    used: dict[str, float] = {}
    for pid, (what, cpu) in after.items():
        spent = cpu - before.get(pid, (what, 0.0))[1]
        used[what] = round(used.get(what, 0.0) + spent, 2)
    return dict(sorted(used.items()))


@dataclass
class Throughput:
    launcher: str
    rep: int
    samples_per_s: float | None = None
    step_seconds: float | None = None  # mean over the window
    median_step_seconds: float | None = None  # median gap between the window's steps
    world: int | None = None
    load: float | None = None  # 1-minute load average at the window's end
    cpu: dict[str, float] | None = None  # CPU seconds in the window by role (cpu_by_role)
    steal: float | None = None  # % of the machine's CPU time the host took in the window
    error: str | None = None
    scenario: str = ""  # which steady-state run (Steady.scenario)


def throughput_once(
    steady: Steady, launcher: str, rep: int, etcd: Etcd | None, workdir: Path, limits: Limits
) -> Throughput:
    """One job of 2 agents to the window's last step; its samples/s over the window."""
    result = Throughput(launcher, rep, scenario=steady.scenario)
    script = steady.script_for(launcher)
    if script is None:
        raise ValueError(f"{steady.scenario}: no script written for {launcher}")
    endpoint = LAUNCHERS[launcher].endpoint(None if etcd is None else etcd.endpoint)
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    job = Job(
        launcher,
        workdir,
        endpoint,
        "2:2",
        [*steady.args, *(steady.ours_args if launcher.startswith(OURS) else ())],
        run_id,
        script=script,
    )
    workdir.mkdir(parents=True)
    first, last = steady.window

    def reached(step: int) -> Progress | None:
        found = [p for lines in job.logs() for p in parse_progress(lines) if p.step >= step]
        return found[0] if found else None

    try:
        start_agents(job, 2)
        wait_for(f"step {first}", lambda: reached(first), limits.start)
        cpu_before, machine_before = cpu_snapshot(job, etcd), machine_cpu_times()
        wait_for(f"step {last}", lambda: reached(last), limits.start)
        result.cpu = cpu_by_role(cpu_before, cpu_snapshot(job, etcd))
        result.steal = steal_percent(machine_before, machine_cpu_times())
        result.load = round(os.getloadavg()[0], 2)
        progress = [p for lines in job.logs() for p in parse_progress(lines)]
        result.median_step_seconds = median_gap(progress, first, last)
        result.samples_per_s = window_rate(progress, first, last)
        if result.samples_per_s is None:
            result.error = f"steps {first}-{last} were not trained by one steady group"
        else:
            ends = [p for p in progress if p.step in (first, last)]
            result.step_seconds = round((ends[-1].t - ends[0].t) / (last - first), 4)
            result.world = ends[-1].world
    except TimeoutError as exc:
        result.error = str(exc)
        (workdir / "timeout.txt").write_text(job.tail(40))
    finally:
        job.stop()
        shutil.rmtree(Path("/dev/shm/elasticjob") / run_id, ignore_errors=True)
    return result


def throughput(
    steady: Steady,
    launchers: Sequence[str],
    etcd: Etcd | None,
    workdir: Path,
    limits: Limits,
    reps: int,
) -> tuple[list[Figure], list[Throughput]]:
    """Ours beside each other launcher, one job at a time; the order alternates."""
    runs: list[Throughput] = []
    name = steady.scenario
    for lch in launchers:
        if steady.script_for(lch) is None:
            print(f"{name}: {lch} skipped, no script written for it", flush=True)
    baselines = [lch for lch in launchers if lch != OURS and steady.script_for(lch) is not None]
    if OURS not in launchers or not baselines:
        print(f"{name}: skipped, it needs {OURS} and another launcher", flush=True)
        return [], runs
    for rep in range(reps):
        order = [OURS, *baselines] if rep % 2 == 0 else [*baselines, OURS]
        for launcher in order:
            where = workdir / f"{name}-{launcher}-{rep}"
            r = throughput_once(steady, launcher, rep, etcd, where, limits)
            shown = (
                f"{r.samples_per_s:.1f} samples/s ({r.step_seconds:.3f} s/step mean, "
                f"{r.median_step_seconds or 0:.3f} median, load {r.load}, host steal "
                f"{r.steal}%; CPU s {r.cpu})"
                if r.samples_per_s is not None
                else f"FAILED: {r.error}"
            )
            print(f"{name:<15} {launcher:<17} rep {rep}: {shown}", flush=True)
            runs.append(r)
    return [throughput_figure(steady, runs, b) for b in baselines], runs


def throughput_figure(steady: Steady, runs: Sequence[Throughput], baseline: str) -> Figure:
    ours = [r for r in runs if r.launcher == OURS]
    base = [r for r in runs if r.launcher == baseline]
    fig = Figure(
        steady.scenario,
        steady.case,
        "samples/s at world 2 (higher is better)",
        "samples/s",
        ours=[round(r.samples_per_s, 2) for r in ours if r.samples_per_s is not None],
        baseline=[round(r.samples_per_s, 2) for r in base if r.samples_per_s is not None],
        baseline_name=steady.baseline_name(baseline),
        target=f"ours/baseline >= {steady.target:g}",
        failures=[f"{r.launcher}: {r.error}" for r in (*ours, *base) if r.error],
    )
    ratio = fig.ratio
    fig.met = None if ratio is None else ratio >= steady.target
    per_rep = [
        f"{a.samples_per_s / b.samples_per_s:.3f}"
        for a, b in zip(ours, base, strict=False)
        if a.samples_per_s and b.samples_per_s
    ]
    typical = [
        statistics.median(m) if m else None
        for m in (
            [r.median_step_seconds for r in rs if r.median_step_seconds is not None]
            for rs in (ours, base)
        )
    ]
    fig.note = "ratio per repetition: " + (", ".join(per_rep) or "-")
    steals = [
        f"{a.steal} vs {b.steal}"
        for a, b in zip(ours, base, strict=False)
        if a.steal is not None and b.steal is not None
    ]
    if steals:
        fig.note += "; host steal % per repetition, ours vs baseline: " + ", ".join(steals)
    if typical[0] is not None and typical[1] is not None:
        fig.note += (
            f"; median step {typical[0]:.3f} s vs {typical[1]:.3f} s "
            f"(baseline/ours {typical[1] / typical[0]:.3f})"
        )
    cpu = [cpu_per_step(rs, steady.window) for rs in (ours, base)]
    if cpu[0] and cpu[1]:
        shown = [
            f"{what} {cpu[0].get(what, 0.0) * 1000:.0f} vs {cpu[1].get(what, 0.0) * 1000:.0f}"
            for what in sorted(set(cpu[0]) | set(cpu[1]))
        ]
        fig.note += "; CPU ms per step, ours vs baseline: " + ", ".join(shown)
    return fig


def cpu_per_step(runs: Sequence[Throughput], window: tuple[int, int]) -> dict[str, float]:
    """Median CPU seconds per step of the window, by role (:func:`cpu_by_role`): less
    moved by a neighbour's load than the wall clock is, on a shared host."""
    steps = window[1] - window[0]
    by: dict[str, list[float]] = {}
    for r in runs:
        for what, seconds in (r.cpu or {}).items():
            by.setdefault(what, []).append(seconds / steps)
    return {what: statistics.median(v) for what, v in by.items()}


# ---------------------------------------------------------------- faults and goodput


# scenario, summary key, metric, target in seconds (None: reported, no target)
Row = tuple[str, str, str, float | None]
GPT_ROWS: tuple[Row, ...] = (
    ("gpt-worker-kill", "seconds", "SIGKILL a worker -> next step", 1.0),
    ("gpt-worker-kill", "pause", "training paused (last step -> next step)", 1.0),
    ("gpt-scale-up", "seconds", "agent joins (2->3) -> step at 3", None),
    ("gpt-scale-up", "pause", "training paused (last step -> next step)", 1.0),
)


def fault_figures(
    summary: dict[str, dict[str, dict[str, Any]]],
    launchers: Sequence[str],
    rows: Sequence[Row] = GPT_ROWS,
    case: str = "train_gpt.py vs the launcher's own script",
    baseline_name: Callable[[str], str] = baseline_name,
    note_name: Callable[[str], str] = lambda launcher: "baseline",
) -> list[Figure]:
    """Recovery ``rows`` (the GPT ones by default; bench/classic.py passes its own), ours
    beside each baseline launcher, from bench.run's summary, each with its target."""
    out: list[Figure] = []
    for baseline in (lch for lch in launchers if lch != OURS):
        for scenario, key, metric, target in rows:
            mine = summary.get(OURS, {}).get(scenario)
            theirs = summary.get(baseline, {}).get(scenario)
            if mine is None and theirs is None:
                continue
            fig = Figure(
                scenario,
                case,
                metric,
                "s",
                ours=list(mine[key]) if mine else [],
                baseline=list(theirs[key]) if theirs else [],
                baseline_name=baseline_name(baseline),
                target=None if target is None else f"<= {target:g} s",
                failures=[f for f in (mine or {}).get("failures", []) if f],
            )
            if target is not None and fig.ours_median is not None:
                fig.met = fig.ours_median <= target
            if key == "pause":
                steps = [
                    f"{statistics.median(c['step_time']):.2f} s"
                    if c and c.get("step_time")
                    else "-"
                    for c in (mine, theirs)
                ]
                fig.note = (
                    f"a pause includes one step; the steady step before the fault: "
                    f"{steps[0]} (ours), {steps[1]} ({note_name(baseline)})"
                )
            out.append(fig)
    return out


def goodput_figures(goodputs: Sequence[Goodput], launchers: Sequence[str]) -> list[Figure]:
    by = {g.launcher: g for g in goodputs if g.scenario == "gpt-goodput"}
    ours = by.get(OURS)
    out = []
    for baseline in (lch for lch in launchers if lch != OURS and lch in by):
        theirs = by[baseline]
        fig = Figure(
            "gpt-goodput",
            "train_gpt.py vs the launcher's own script",
            f"goodput, a worker SIGKILLed every 30 s for {theirs.window / 60:.1f} min",
            "%",
            ours=[100 * ours.goodput] if ours is not None and ours.goodput is not None else [],
            baseline=[100 * theirs.goodput] if theirs.goodput is not None else [],
            baseline_name=baseline_name(baseline),
            target=f">= {100 * GOODPUT_TARGET:g} %",
            failures=[g.error for g in (ours, theirs) if g is not None and g.error],
        )
        if fig.ours_median is not None:
            fig.met = fig.ours_median >= 100 * GOODPUT_TARGET
        out.append(fig)
    return out
