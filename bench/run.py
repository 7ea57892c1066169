"""`make bench`: recovery and scale-up times of elasticjob-run beside torchrun's.

Same training script (examples/train_regression.py, one step line per step with a unix
timestamp), same machine, a real etcd on loopback. Scenarios:

* ``worker-kill``: 2 agents (``--nnodes=2:2``); SIGKILL one agent's worker process.
* ``node-kill``:   3 agents (``--nnodes=2:3``); SIGKILL one agent and its worker together.
* ``scale-up``:    2 agents (``--nnodes=2:3``) training; start a third agent.
* ``scale-down``:  3 agents (``--nnodes=2:3``); SIGTERM one agent (not its workers), as
  the kubelet stops a pod on a scale-down, a drain or a preemption: ours announces the
  departure and hands over (rendezvous/departure.py), torchrun stops its workers.
* ``node-freeze`` (not run by default): like node-kill, but SIGSTOP: a node that vanishes
  without closing its connections, so no peer sees a reset socket.
* ``allreduce-kill`` (not run by default): like worker-kill, but the worker SIGKILLs
  itself inside its gradient all-reduce (bench/allreduce_kill/sitecustomize.py), 0-3 ms
  into it by repetition, and the table says in how many runs the survivor kept its process.

Recovery time is from the kill to the first training step completed after it by a
worker process started after it (an old worker finishing a step already in flight does
not count); scale-up time is from starting the new agent's process (interpreter start
and imports included) to the first step at world size 3. Launchers run with their
defaults apart from ``--max-restarts=3`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(without it torch 2.13's c10d scale-up crashes, see docs/design.md).

Every scenario has hard timeouts and ends by killing every process it started by its
recorded process group. Results: a table on stdout, ``bench/results/latest.json`` and a
dated copy beside it.

The scale scenarios of their own modules run from here too, each figure beside its
baseline from the same run (:mod:`bench.report`), written to ``bench/results/scale.json``
and ``.md`` (and the rendezvous plot):

* ``checkpoint-stall`` (:mod:`bench.checkpoint_stall`): an async save's stall beside a
  synchronous ``torch.save``; ``--checkpoint-sizes``.
* ``rdzv-round``, ``rdzv-lost``, ``rdzv-etcd-load`` (:mod:`bench.rdzv_scale`): N light
  agents beside torch's c10d handler; ``--rdzv-sizes``.
* ``operator-load`` (:mod:`bench.operator_load`, only in ``--full`` or asked for): 50
  ElasticJobs x 8 workers applied at once on the devcluster, per-job etcds beside one
  shared etcd; ``--operator-nodes``.

The realistic script beside its plain-DDP original (:mod:`bench.real_scripts`), in the
recovery results (``bench/results/<date>.json``, ``real_scripts``) and a table with the
ratio; not in the default set (about 12 minutes more with ``--reps 3``), but
``--scenarios real-scripts``:

* ``gpt-throughput``: samples/s of examples/train_gpt.py under elasticjob-run and of
  bench/gpt_plain.py under torchrun, one job at a time.
* ``gpt-worker-kill``, ``gpt-scale-up``: worker-kill and scale-up with those scripts.
* ``check-cost`` (:mod:`bench.check_cost`): the Run's agreement check and step seeding,
  in percent of a step.
* ``ledger-cost`` (:mod:`bench.ledger_cost`): keeping the goodput ledger, in percent of a
  step of the regression example (and its encoding, per second, off the step).
* ``gpt-goodput`` (only when named): the goodput run with those scripts.

An unchanged classic torchelastic script (:mod:`bench.classic`: bench/classic_imagenet.py,
its own checkpoints, ``ElasticDistributedSampler``, DataLoader workers, a ResNet-18)
under both launchers, with each recovery split into the launcher's phases and the
script's own start-up; not in the default set, but ``--scenarios classic``:

* ``classic-worker-kill``, ``classic-node-kill``, ``classic-scale-up``.

The default set stays under 15 minutes on 2 cores. ``--full`` runs the recovery
scenarios and every scale scenario at every size (goodput and node-freeze only when
asked: they take 11 minutes and torchrun's whole recover timeout); a rendezvous handler
that failed at some N is not tried again at that N or above in the same run (it can only
take longer, and each failure costs the whole phase timeout). operator-load alone takes
about 26 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from bench import (
    check_cost,
    checkpoint_stall,
    classic,
    ledger_cost,
    operator_load,
    phases,
    rdzv_scale,
    real_scripts,
    sharded,
)
from bench.goodput import Goodput, run_goodput, steady_step_time
from bench.harness import (
    REPO,
    SCRIPT,
    Etcd,
    Job,
    Limits,
    StepLine,
    first_step_after,
    start_agents,
    wait_for,
)
from bench.launchers import LAUNCHERS, Workload
from bench.plot import plot_goodput
from bench.report import Figure, markdown_table, render, write

RESULTS = REPO / "bench" / "results"
SCENARIOS = (
    "worker-kill",
    "node-kill",
    "scale-up",
    "scale-down",
    "goodput",
    "node-freeze",
    "allreduce-kill",
)
SCALE_SCENARIOS = ("checkpoint-stall", *rdzv_scale.SCENARIOS, *operator_load.SCENARIOS)
# goodput (10 minutes) and node-freeze (torchrun's full --recover-timeout) only on demand
DEFAULT_SCENARIOS = (
    "worker-kill",
    "node-kill",
    "scale-up",
    "scale-down",
    "checkpoint-stall",
    "rdzv-round",
)
FULL = {
    "scenarios": [*SCENARIOS[:4], *SCALE_SCENARIOS],
    "rdzv_sizes": [64, 256, 1024],
    "checkpoint_sizes": ["100MB", "1GB"],
    "rdzv_timeout": 180.0,  # ours formed 1024 in 45-60 s at load 200 here
}
DEFAULT_LAUNCHERS = ("elasticjob-run", "torchrun-c10d")
CHECKPOINT_INTERVAL = 20
WARMUP_STEPS = 2 * CHECKPOINT_INTERVAL  # a checkpoint exists before any fault
# Faults come at a steady state: this long after the job first trains steadily, for both
# launchers alike (a fault a second after a start would also find our replacement spares
# still importing torch: no slower than a cold start, but not the common case).
SETTLE_SECONDS = 8.0
GOODPUT_INTERVAL = 30.0  # seconds between the goodput run's worker kills
SAME_STEP_S = 0.5  # two lines of a step this close are one step logged twice
TRAIN_ARGS = [
    "--steps=1000000",
    "--epochs=1000",
    "--log-every=1",
    "--sleep=0.05",
    f"--checkpoint-interval={CHECKPOINT_INTERVAL}",
    "--batch-size=32",
    "--samples=8192",
]


@dataclass
class Result:
    launcher: str
    scenario: str
    rep: int
    seconds: float | None = None  # fault (or join) -> first step after it
    steps_redone: int | None = None  # steps trained again after the restore
    worker_startup: float | None = None  # of ``seconds``: new worker's exec -> restored
    pause: float | None = None  # the last step before the first step after (training stopped)
    phases: dict[str, float] | None = None  # bench.phases.breakdown of the recovery
    step_time: float | None = None  # steady seconds per step before the fault (pause includes one)
    # a resize: steady seconds per step at the new world, of which the pause holds one
    step_time_after: float | None = None
    load: float | None = None  # 1-minute load average when the fault was injected
    gave_up_after: float | None = None  # no recovery within this many seconds of the fault
    world_before: int | None = None
    world_after: int | None = None
    # allreduce-kill: every survivor's process still the same one once training went on
    survivors_kept: bool | None = None
    error: str | None = None


def steady(job: Job, world: int) -> StepLine | None:
    """A step at ``world`` past the warm-up (so a checkpoint exists)."""
    return next((s for s in job.steps() if s.world == world and s.step >= WARMUP_STEPS), None)


def run_scenario(
    scenario: str,
    launcher: str,
    rep: int,
    etcd: Etcd,
    workdir: Path,
    limits: Limits,
    script: Path = SCRIPT,
    train_args: Sequence[str] = TRAIN_ARGS,
    label: str | None = None,
) -> Result:
    """One fault (``scenario``) in a fresh job of ``launcher`` running ``script``;
    reported under ``label`` (default: the scenario)."""
    result = Result(launcher, label or scenario, rep)
    endpoint = LAUNCHERS[launcher].endpoint(etcd.endpoint)
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    nnodes, agents, world_after = {
        "worker-kill": ("2:2", 2, 2),
        "worker-kill-4": ("4:4", 4, 4),
        "allreduce-kill": ("2:2", 2, 2),
        "node-kill": ("2:3", 3, 2),
        "node-freeze": ("2:3", 3, 2),
        "scale-up": ("2:3", 2, 3),
        "scale-down": ("2:3", 3, 2),
    }[scenario]
    job = Job(launcher, workdir, endpoint, nnodes, list(train_args), run_id, script=script)
    trigger = workdir / "allreduce-kill"
    if scenario == "allreduce-kill":
        job.extra_env = allreduce_kill_env(launcher, trigger)
    survivors: list[int] = []
    workdir.mkdir(parents=True)
    try:
        start_agents(job, agents)
        first = wait_for(
            f"training at world size {agents}", lambda: steady(job, agents), limits.start
        )
        time.sleep(max(0.0, first.t + SETTLE_SECONDS - time.time()))
        job.remember_pids()
        result.world_before = agents
        result.load = round(os.getloadavg()[0], 2)
        old_pids = {s.pid for s in job.steps()}
        if scenario.startswith("worker-kill"):
            victim = job.agents[-1]
            workers = wait_for("a worker process", lambda: victim.workers() or None, 30)
            old_pids.update(workers)
            fault_at = time.time()
            for pid in workers:
                os.kill(pid, 9)
        elif scenario == "allreduce-kill":  # it dies at its next gradient all-reduce
            victim = job.agents[-1]
            workers = wait_for("a worker process", lambda: victim.workers() or None, 30)
            survivors = [pid for agent in job.agents[:-1] for pid in agent.workers()]
            old_pids.update(workers, survivors)
            fault_at = time.time()
            delays = ALLREDUCE_KILL_DELAYS_MS
            write_trigger(trigger, workers[0], delays[rep % len(delays)])
        elif scenario in ("node-kill", "node-freeze"):
            for agent in job.agents:
                old_pids.update(agent.workers())
            fault_at = time.time()
            if scenario == "node-kill":
                job.agents[-1].kill_node()
            else:
                job.agents[-1].freeze()
        elif scenario == "scale-down":
            for agent in job.agents:
                old_pids.update(agent.workers())
            fault_at = time.time()
            job.agents[-1].terminate()
        else:
            fault_at = time.time()
            job.start_agent()
        try:
            after = wait_for(
                f"a training step after the {scenario}",
                lambda: first_step_after(
                    job.steps(), fault_at, old_pids, world_after, job.regrouped_after(fault_at)
                ),
                limits.recover,
            )
        except TimeoutError:
            result.gave_up_after = limits.recover
            raise
        result.seconds = round(after.t - fault_at, 2)
        if scenario == "allreduce-kill":
            result.survivors_kept = bool(survivors) and all(map(alive, survivors))
        before_fault = steady_step_time(job.steps(), fault_at)
        result.step_time = None if before_fault is None else round(before_fault, 3)
        startup = [secs for t, secs in job.startups() if fault_at < t <= after.t]
        result.worker_startup = startup[-1] if startup else None
        result.world_after = after.world
        result.steps_redone = steps_redone(job.steps(), old_pids, fault_at, after)
        last = max((s.t for s in job.steps() if s.t < after.t and s.pid in old_pids), default=None)
        result.pause = longest_pause(job.steps(), fault_at, after)
        if scenario in ("scale-up", "scale-down"):  # the group trains on after the fault
            result.phases = recovery_phases(job, last, after, reacted_after=fault_at)
            result.step_time_after = step_time_after(job, after)
        else:
            result.phases = recovery_phases(job, fault_at, after)
    except TimeoutError as exc:
        result.error = str(exc)
        (workdir / "timeout.txt").write_text(job.tail(40))
    finally:
        job.stop()
        shutil.rmtree(Path("/dev/shm/elasticjob") / run_id, ignore_errors=True)
    return result


# how long the victim lets its all-reduce run before it dies, by repetition: from at once
# to past the whole collective (a few hundred microseconds for this model on loopback)
ALLREDUCE_KILL_DELAYS_MS = (0.0, 0.1, 0.3, 1.0, 3.0)
ALLREDUCE_KILL_HOOK = REPO / "bench" / "allreduce_kill"


def allreduce_kill_env(launcher: str, trigger: Path) -> dict[str, str]:
    """The workers' environment for bench/allreduce_kill/sitecustomize.py."""
    path = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": f"{ALLREDUCE_KILL_HOOK}:{path}" if path else str(ALLREDUCE_KILL_HOOK),
        "BENCH_ALLREDUCE_KILL": str(trigger),
        "BENCH_ALLREDUCE_KILL_IN": "torchft" if launcher.startswith("torchft") else "torch",
    }


def write_trigger(trigger: Path, pid: int, delay_ms: float) -> None:
    """Name the victim, whole or not at all (a worker reads it every step)."""
    partial = trigger.with_suffix(".partial")
    partial.write_text(f"{pid} {delay_ms}")
    partial.rename(trigger)


def alive(pid: int) -> bool:
    """The process is there and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def step_time_after(
    job: Job, after: StepLine, steps: int = 4, within: float = 30.0
) -> float | None:
    """The median time between the next ``steps`` steps at ``after``'s world (the pause
    of a resize holds one step at the new world, slower or faster than one before it);
    None when they do not come within ``within`` seconds."""

    def gaps() -> list[float] | None:
        later = [s for s in job.steps() if s.t > after.t and s.world == after.world]
        out = [
            b.t - a.t
            for a, b in pairwise([after, *later])
            if a.pid == b.pid and b.step == a.step + 1
        ]
        return out if len(out) >= steps else None

    try:
        return round(statistics.median(wait_for("steps at the new world", gaps, within)), 3)
    except TimeoutError:
        return None


def longest_pause(steps: Sequence[StepLine], fault_at: float, after: StepLine) -> float | None:
    """How long training stopped: the longest time without a step line, from the last
    step before the fault to ``after``. Every logged step counts, whoever logged it (a
    peer whose replica groups all log their steps, an old worker finishing a step in
    flight, a step trained again after a restore)."""
    times = sorted(s.t for s in steps if s.t <= after.t)
    before = [t for t in times if t <= fault_at]
    if not before:
        return None
    window = [before[-1], *(t for t in times if t > fault_at)]
    return round(max((b - a for a, b in pairwise(window)), default=0.0), 2)


def steps_redone(
    steps: Sequence[StepLine], old_pids: set[int], fault_at: float, after: StepLine
) -> int | None:
    """How many steps the group that trained ``after`` trains again: the last step done
    before it (at the fault, or later by an old worker: a scale-up's group trains on
    while the newcomer starts, a step in flight may finish) less the step ``after``
    resumed from. Lines within :data:`SAME_STEP_S` of ``after`` are the same step logged
    by another replica group (torchft's groups each log every step), not one before it."""
    before = [
        s.step
        for s in steps
        if s.t <= fault_at or (s.t < after.t - SAME_STEP_S and s.pid in old_pids)
    ]
    return max(0, max(before) - (after.step - 1)) if before else None


def flag_value(args: Sequence[str], flag: str) -> int:
    """The integer a ``--flag=N`` of ``args`` gives."""
    for arg in args:
        if arg.startswith(f"{flag}="):
            return int(arg.split("=", 1)[1])
    raise ValueError(f"{flag}=N is not among {list(args)}")


def goodput_run(
    launcher: str,
    etcd: Etcd,
    workdir: Path,
    limits: Limits,
    minutes: float,
    seed: int,
    script: Path = SCRIPT,
    train_args: Sequence[str] = TRAIN_ARGS,
    label: str = "goodput",
) -> Goodput:
    """Two agents, a worker SIGKILLed every 30 s (same seeded draws for every launcher);
    every rank logs its samples, for the data the run trained (bench/coverage.py)."""
    endpoint = LAUNCHERS[launcher].endpoint(etcd.endpoint)
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    # every kill is charged to the victim's agent: give both launchers room for all of them
    restarts = int(minutes * 60 / GOODPUT_INTERVAL) + 1
    job = Job(
        launcher,
        workdir,
        endpoint,
        "2:2",
        [*train_args, "--log-samples=1"],
        run_id,
        max_restarts=restarts,
        script=script,
    )
    workdir.mkdir(parents=True)
    try:
        start_agents(job, 2)
        first = wait_for("training at world size 2", lambda: steady(job, 2), limits.start)
        time.sleep(max(0.0, first.t + SETTLE_SECONDS - time.time()))
        samples = flag_value(train_args, "--samples")
        interval = flag_value(train_args, "--checkpoint-interval")
        return run_goodput(job, minutes, GOODPUT_INTERVAL, seed, label, samples, interval)
    except TimeoutError as exc:
        (workdir / "timeout.txt").write_text(job.tail(40))
        return Goodput(launcher, label, error=str(exc))
    finally:
        job.stop()
        shutil.rmtree(Path("/dev/shm/elasticjob") / run_id, ignore_errors=True)


def recovery_phases(
    job: Job, start: float | None, after: StepLine, reacted_after: float | None = None
) -> dict[str, float] | None:
    """Where the time from ``start`` (the fault, or for a scale-up the last step before
    the switch) to ``after`` went; None when the logs lack a mark. With ``reacted_after``
    (a scale-up), an agent that reacted after it but before ``start`` moves the start
    there: agents that regroup in place run the rendezvous while their group trains."""
    if start is None:
        return None
    year = datetime.now().year
    logs = job.logs()
    events = [phases.agent_events(lines, year) for lines in logs]
    if reacted_after is not None:
        early = [
            e.t
            for found in events
            for e in found
            if e.what == "stopping" and reacted_after < e.t < start
        ]
        start = min([start, *early])
    marks = [phases.script_marks(lines) for lines in logs]
    if any(t > start for found in marks for m in found.values() for t in m.values()):
        # a script that logs its start-up marks (bench.classic): the finest split
        return phases.classic_breakdown(start, list(zip(events, marks, strict=True)), after.t)
    ups = [u for lines in logs for u in phases.startups(lines) if start < u.t <= after.t]
    if not ups:  # a script without the startup= line (bench.real_scripts): coarser phases
        ready = [t for lines in logs for t in phases.ready_marks(lines) if start < t <= after.t]
        return phases.coarse_breakdown(start, events, max(ready, default=None), after.t)
    return phases.breakdown(start, events, max(ups, key=lambda u: u.t), after.t)


# ---------------------------------------------------------------- reporting


def summarize(results: Sequence[Result]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per launcher and scenario: median/min/max seconds, runs, failures, steps redone."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        cell = out.setdefault(r.launcher, {}).setdefault(
            r.scenario,
            {
                "seconds": [],
                "failures": [],
                "steps_redone": [],
                "worker_startup": [],
                "pause": [],
                "phases": [],
                "step_time": [],
                "step_time_after": [],
            },
        )
        if r.seconds is None:
            cell["failures"].append(r.error)
            if r.gave_up_after is not None:
                cell.setdefault("gave_up_after", []).append(r.gave_up_after)
        else:
            cell["seconds"].append(r.seconds)
            if r.survivors_kept is not None:
                cell.setdefault("survivors_kept", []).append(r.survivors_kept)
            if r.steps_redone is not None:
                cell["steps_redone"].append(r.steps_redone)
            if r.worker_startup is not None:
                cell["worker_startup"].append(r.worker_startup)
            if r.pause is not None:
                cell["pause"].append(r.pause)
            if r.phases is not None:
                cell["phases"].append(r.phases)
            if r.step_time is not None:
                cell["step_time"].append(r.step_time)
            if r.step_time_after is not None:
                cell["step_time_after"].append(r.step_time_after)
    for scenarios in out.values():
        for cell in scenarios.values():
            secs = cell["seconds"]
            cell["median"] = round(statistics.median(secs), 2) if secs else None
            cell["min"] = min(secs, default=None)
            cell["max"] = max(secs, default=None)
            cell["n"] = len(secs)
            cell["pause_median"] = (
                round(statistics.median(cell["pause"]), 2) if cell["pause"] else None
            )
            after = cell.get("step_time_after") or []
            cell["step_time_after_median"] = round(statistics.median(after), 3) if after else None
            # the names every run of the cell has (a coarse breakdown may lack "ready")
            runs = cell["phases"]
            names = [n for n in runs[0] if all(n in p for p in runs)] if runs else []
            cell["phases_median"] = (
                {n: round(statistics.median(p[n] for p in cell["phases"]), 2) for n in names}
                if cell["phases"]
                else None
            )
    return out


def survivors_kept(cell: dict[str, Any]) -> str:
    """'k of n': runs whose survivors trained on in their own process, of every run (one
    that never trained again kept nothing)."""
    kept = cell.get("survivors_kept")
    if kept is None:
        return "-"
    return f"{sum(kept)} of {len(cell['seconds']) + len(cell['failures'])}"


def format_cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    if cell["median"] is None:
        if len(cell.get("gave_up_after", [])) == len(cell["failures"]):
            return f"> {min(cell['gave_up_after']):.0f} s (no step, n={len(cell['failures'])})"
        return f"failed ({len(cell['failures'])})"
    text = f"{cell['median']:.1f} s"
    if cell["n"] > 1:
        text += f" ({cell['min']:.1f}-{cell['max']:.1f}, n={cell['n']})"
    if cell["failures"]:
        text += f", {len(cell['failures'])} failed"
    return text


LABELS = {
    "worker-kill": "SIGKILL a worker -> next step",
    "allreduce-kill": "a worker SIGKILLed inside its gradient all-reduce -> next step",
    "node-kill": "SIGKILL an agent (3->2) -> next step",
    "node-freeze": "SIGSTOP an agent (3->2) -> next step",
    "scale-up": "agent joins (2->3) -> step at 3",
    "scale-down": "SIGTERM an agent (3->2) -> step at 2",
    "gpt-worker-kill": "train_gpt / gpt_plain: SIGKILL a worker -> next step",
    "gpt-scale-up": "train_gpt / gpt_plain: agent joins (2->3) -> step at 3",
    "classic-worker-kill": "classic_imagenet: SIGKILL a worker -> next step",
    "classic-node-kill": "classic_imagenet: SIGKILL an agent (3->2) -> next step",
    "classic-scale-up": "classic_imagenet: agent joins (2->3) -> step at 3",
    "fsdp-worker-kill": "train_gpt_fsdp / gpt_fsdp_plain: SIGKILL a worker -> next step",
    "fsdp-node-kill": "train_gpt_fsdp / gpt_fsdp_plain: SIGKILL an agent (3->2) -> next step",
    "fsdp-scale-up": "train_gpt_fsdp / gpt_fsdp_plain: agent joins (2->3) -> step at 3",
    "hsdp-worker-kill": "train_gpt_fsdp HSDP 2 x 2: SIGKILL a worker -> next step",
}
GOODPUT_LABELS = {
    "goodput": "goodput, a worker SIGKILLed every {:.0f} s",
    "gpt-goodput": "train_gpt / gpt_plain: goodput, a worker SIGKILLed every {:.0f} s",
}


PHASE_LABELS = {
    phases.PHASES: "detect/rendezvous/worker/pg/restore/step",
    phases.COARSE: "detect/rendezvous/ready/step",
    phases.CLASSIC: "detect/rendezvous/worker/pg/model/ckpt/ddp/loader/step",
}


def phase_names(scenario: str) -> tuple[str, ...]:
    """The phases the table shows for ``scenario``'s script."""
    if scenario in real_scripts.FAULTS or scenario in sharded.FAULTS:
        return phases.COARSE
    if scenario in classic.FAULTS:
        return phases.CLASSIC
    return phases.PHASES


def table(
    summary: dict[str, dict[str, dict[str, Any]]],
    launchers: Sequence[str],
    goodputs: Sequence[Goodput] = (),
) -> str:
    rows = [["scenario", *launchers]]
    for scenario in (*SCENARIOS, *real_scripts.FAULTS, *classic.FAULTS, *sharded.FAULTS):
        if scenario == "goodput":
            continue
        if any(scenario in summary.get(lch, {}) for lch in launchers):
            row = [LABELS[scenario]]
            row += [format_cell(summary.get(lch, {}).get(scenario)) for lch in launchers]
            rows.append(row)
            names = phase_names(scenario)
            pause = ["  training paused (last step -> next step)"]
            split = ["  " + PHASE_LABELS[names]]
            redone = ["  steps redone (median)"]
            one_step = ["  of the pause, one step at the new world"]
            kept = ["  survivor kept its process (of all runs)"]
            for lch in launchers:
                cell = summary.get(lch, {}).get(scenario, {})
                value = cell.get("pause_median")
                pause.append(f"{value:.1f} s" if value is not None else "-")
                med = cell.get("phases_median")
                split.append(
                    "/".join(f"{med[n]:.1f}" if n in med else "-" for n in names) if med else "-"
                )
                steps = cell.get("steps_redone") or []
                redone.append(f"{statistics.median(steps):g}" if steps else "-")
                step = cell.get("step_time_after_median")
                one_step.append(f"{step:.1f} s" if step is not None else "-")
                kept.append(survivors_kept(cell))
            rows += [pause, split, redone]
            if any(v != "-" for v in one_step[1:]):
                rows.append(one_step)
            if any(v != "-" for v in kept[1:]):
                rows.append(kept)
    for scenario, label in GOODPUT_LABELS.items():
        by = {g.launcher: g for g in goodputs if g.scenario == scenario}
        if not by:
            continue
        row = [label.format(GOODPUT_INTERVAL)]
        for lch in launchers:
            g = by.get(lch)
            row.append("-" if g is None or g.goodput is None else f"{g.goodput:.1%}")
        rows.append(row)
        share = ["  each step weighed by the share of the group that trained it"]
        for lch in launchers:
            g = by.get(lch)
            value = None if g is None else g.goodput_samples
            share.append("-" if value is None else f"{value:.1%}")
        rows.append(share)
        spread = ["  samples trained evenly / more / less often (bench/coverage.py)"]
        for lch in launchers:
            c = None if (g := by.get(lch)) is None else g.coverage
            spread.append("-" if c is None else f"{c.even:.1%} / {c.repeated:.1%} / {c.missed:.1%}")
        if any(v != "-" for v in spread[1:]):
            rows.append(spread)
    return render(rows)


def source_state() -> dict[str, Any]:
    """The commit measured and whether the runtime/example differed from it."""
    import subprocess

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        return out.stdout.strip()

    dirty = git("status", "--porcelain", "--", "trainer-runtime", "examples", "bench")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": dirty.splitlines()}


def machine() -> dict[str, Any]:
    import torch
    from elasticjob_examples.train_gpt import cpu_has_bf16  # type: ignore[import-not-found]

    return {
        "cpus": os.cpu_count(),
        # the realistic scripts' --autocast auto: bf16 only on a CPU that has it
        "cpu_bf16": cpu_has_bf16(),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition (default: --reps)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per launcher and scenario")
    p.add_argument("--launchers", nargs="+", default=list(DEFAULT_LAUNCHERS), choices=LAUNCHERS)
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=list(DEFAULT_SCENARIOS),
        choices=(
            *SCENARIOS,
            *SCALE_SCENARIOS,
            *real_scripts.SCENARIOS,
            real_scripts.GROUP,
            *classic.SCENARIOS,
            classic.GROUP,
            *sharded.SCENARIOS,
            sharded.GROUP,
        ),
        help="node-freeze (a node that vanishes without closing its sockets) is not in the "
        "default set: torchrun sits in the collective until its timeout; "
        f"{real_scripts.GROUP} = {' '.join(real_scripts.GROUP_SCENARIOS)} (the realistic "
        "script beside its plain-DDP original, and what the agreement check and the goodput "
        "ledger cost a step; gpt-goodput only when named); "
        f"{classic.GROUP} = {' '.join(classic.SCENARIOS)} (an unchanged classic torchelastic "
        "script under both launchers, each recovery split into phases); "
        f"{sharded.GROUP} = {' '.join(sharded.SCENARIOS)} (an FSDP2 model in place, beside "
        "the restart path (launcher elasticjob-run-restart) and torchrun)",
    )
    p.add_argument(
        "--full", action="store_true", help=f"every scale scenario at every size: {FULL}"
    )
    p.add_argument("--rdzv-sizes", nargs="+", type=int, default=[64, 256], help="agents")
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=60.0,
        help="seconds per phase (ours forms 256 in 2-3 s; torch's handler forms none in 120)",
    )
    p.add_argument(
        "--operator-nodes", nargs="+", type=int, default=[1, 5], help="operator-load's node counts"
    )
    p.add_argument("--operator-jobs", type=int, default=50, help="operator-load's ElasticJobs")
    p.add_argument("--operator-workers", type=int, default=8, help="workers per job")
    p.add_argument(
        "--checkpoint-sizes", nargs="+", default=["100MB"], help="model + optimizer state"
    )
    p.add_argument("--goodput-minutes", type=float, default=5.0, help="length of the goodput run")
    p.add_argument("--seed", type=int, default=0, help="seed of the goodput run's fault draws")
    p.add_argument("--start-timeout", type=float, default=240.0, help="seconds to start training")
    p.add_argument("--recover-timeout", type=float, default=150.0, help="seconds to recover")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    p.add_argument("--keep", action="store_true", help="keep the logs' temp directory")
    args = p.parse_args(argv)
    if args.full:
        for key, value in FULL.items():
            setattr(args, key, value)
    reps = 1 if args.quick else args.reps
    if reps < 1:
        p.error(f"--reps must be at least 1 (got {reps})")
    for size in args.checkpoint_sizes:
        try:
            checkpoint_stall.parse_size(size)
        except ValueError as exc:
            p.error(f"--checkpoint-sizes {size!r}: {exc}")
    if any(n < 2 for n in args.rdzv_sizes):
        p.error(f"--rdzv-sizes must all be at least 2 (got {args.rdzv_sizes})")
    limits = Limits(args.start_timeout, args.recover_timeout)
    args.scenarios = sharded.expand(classic.expand(real_scripts.expand(args.scenarios)))
    recovery = [s for s in args.scenarios if s in SCENARIOS]
    scale = [s for s in args.scenarios if s in SCALE_SCENARIOS]
    real = [s for s in args.scenarios if s in real_scripts.SCENARIOS]
    unchanged = [s for s in args.scenarios if s in classic.FAULTS]
    sharded_faults = [s for s in args.scenarios if s in sharded.FAULTS]
    sharded_steady = [st for st in sharded.STEADIES if st.scenario in args.scenarios]
    known = (*SCENARIOS, *real_scripts.FAULTS, *classic.FAULTS, *sharded.FAULTS)
    faults = [s for s in args.scenarios if s in known]

    started = time.monotonic()
    info = machine()
    workdir = Path(tempfile.mkdtemp(prefix="elasticjob-bench-"))
    results: list[Result] = []
    goodputs: list[Goodput] = []
    real_figures: list[Figure] = []
    throughputs: list[real_scripts.Throughput] = []
    figures: list[Figure] = []
    sharded_figures: list[Figure] = []
    sharded_runs: list[real_scripts.Throughput] = []
    needs_etcd = (
        recovery
        or unchanged
        or sharded_faults
        or sharded_steady
        or [s for s in real if s not in (check_cost.SCENARIO, ledger_cost.SCENARIO)]
    )
    etcd = Etcd.start(workdir / "etcd") if needs_etcd else None
    try:
        if "gpt-throughput" in real:
            found, throughputs = real_scripts.throughput(
                real_scripts.GPT_STEADY, args.launchers, etcd, workdir, limits, reps
            )
            real_figures += found
        for steady in sharded_steady:
            found, steady_runs = real_scripts.throughput(
                steady, args.launchers, etcd, workdir, limits, reps
            )
            sharded_figures += found
            sharded_runs += steady_runs
        for rep in range(reps):
            for scenario in faults:
                if scenario == "goodput" or etcd is None:
                    continue
                for launcher in args.launchers:
                    where = workdir / f"{scenario}-{launcher}-{rep}"
                    # the fault bench.run knows, and the script it runs this time
                    fault, train_args = scenario, list(TRAIN_ARGS)
                    if scenario in real_scripts.FAULTS:
                        fault = real_scripts.FAULTS[scenario]
                        script = real_scripts.script_for(launcher)
                        train_args = list(real_scripts.FAULT_ARGS)
                    elif scenario in classic.FAULTS:
                        fault = classic.FAULTS[scenario]
                        script = LAUNCHERS[launcher].script(Workload.CLASSIC)
                        train_args = classic.train_args(where)
                    elif scenario in sharded.FAULTS:
                        if not sharded.runs_under(scenario, launcher):
                            continue
                        fault = sharded.FAULTS[scenario]
                        script = sharded.script_for(launcher)
                        train_args = sharded.train_args(scenario)
                    else:
                        script = LAUNCHERS[launcher].script(Workload.REGRESSION)
                    if script is None:
                        print(f"{scenario:<15} {launcher:<17} no script written for it", flush=True)
                        continue
                    r = run_scenario(
                        fault, launcher, rep, etcd, where, limits, script, train_args, scenario
                    )
                    shown = f"{r.seconds:.2f} s" if r.seconds is not None else f"FAILED: {r.error}"
                    print(f"{scenario:<15} {launcher:<17} rep {rep}: {shown}", flush=True)
                    results.append(r)
        for scenario in ("goodput", "gpt-goodput"):
            if scenario not in args.scenarios or etcd is None:
                continue
            for launcher in args.launchers:
                where = workdir / f"{scenario}-{launcher}"
                script = LAUNCHERS[launcher].script(Workload.REGRESSION)
                train_args = TRAIN_ARGS
                if scenario == "gpt-goodput":
                    script = real_scripts.script_for(launcher)
                    train_args = real_scripts.FAULT_ARGS
                if script is None:
                    print(f"{scenario:<15} {launcher:<17} no script written for it", flush=True)
                    continue
                g = goodput_run(
                    launcher,
                    etcd,
                    where,
                    limits,
                    args.goodput_minutes,
                    args.seed,
                    script,
                    train_args,
                    scenario,
                )
                shown = f"{g.goodput:.1%}" if g.goodput is not None else f"FAILED: {g.error}"
                if g.lost is not None:
                    shown += f" (seconds lost beyond steady steps: {g.lost})"
                print(f"{scenario:<15} {launcher:<17} {shown}", flush=True)
                goodputs.append(g)
        if check_cost.SCENARIO in real:
            real_figures += check_cost.run(reps, workdir)
        if ledger_cost.SCENARIO in real:
            real_figures += ledger_cost.run(reps, workdir)
        if "checkpoint-stall" in scale:
            figures += checkpoint_stall.run(args.checkpoint_sizes, reps, workdir)
        rdzv = [s for s in scale if s in rdzv_scale.SCENARIOS]
        if rdzv:
            figures += rdzv_scale.run(rdzv, args.rdzv_sizes, reps, args.rdzv_timeout, None, workdir)
        if "operator-load" in scale:
            opts = operator_load.Options(args.operator_jobs, args.operator_workers, 300.0, 10.0)
            figures += operator_load.run(
                args.operator_nodes, ["per-job", "shared"], 1, opts, workdir
            )
    finally:
        if etcd is not None:
            etcd.stop()
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    ran_on = {**info, "loadavg_at_end": list(os.getloadavg())}
    if figures:
        scale_json = write(figures, args.out / "scale.json", {"machine": ran_on})
        png = rdzv_scale.plot_round_times(figures, args.out / "scale-rdzv.png")
        print(f"\n{scale_json.with_suffix('.md').read_text()}")
        print(f"written: {scale_json}" + (f", {png}" if png else ""))
    if not recovery and not real and not unchanged and not sharded_faults and not sharded_steady:
        return
    summary = summarize(results)
    real_figures += real_scripts.fault_figures(summary, args.launchers)
    classic_figures = classic.figures(summary, args.launchers) if unchanged else []
    sharded_figures += sharded.figures(summary, args.launchers) if sharded_faults else []
    split = classic.breakdown_table(summary, args.launchers) if unchanged else ""
    real_figures += real_scripts.goodput_figures(goodputs, args.launchers)
    print()
    if results or goodputs:
        print(table(summary, args.launchers, goodputs))
    if real_figures:
        print(f"\n{markdown_table(real_figures)}")
        notes = dict.fromkeys(f"{f.scenario} {f.case}: {f.note}" for f in real_figures if f.note)
        print("\n".join(notes))
    if classic_figures:
        print(f"\n{markdown_table(classic_figures)}")
        notes = dict.fromkeys(f"{f.scenario}: {f.note}" for f in classic_figures if f.note)
        print("\n".join(notes))
    if split:
        print(f"\nWhere the seconds went (medians):\n{split}")
    if sharded_figures:
        print(f"\n{markdown_table(sharded_figures)}")
    doc = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": ran_on,
        "source": source_state(),
        "train_args": TRAIN_ARGS,
        "seconds_total": round(time.monotonic() - started, 1),
        "summary": summary,
        "runs": [asdict(r) for r in results],
        "goodput": [asdict(g) for g in goodputs],
        # bench.real_scripts: each figure beside its baseline (bench.report's shape)
        "real_scripts": {
            "args": {
                "throughput": real_scripts.THROUGHPUT_ARGS,
                "faults": real_scripts.FAULT_ARGS,
                "window": real_scripts.WINDOW,
            },
            "figures": [f.to_json() for f in real_figures],
            "throughput_runs": [asdict(t) for t in throughputs],
        }
        if real
        else None,
        # bench.classic: the unchanged classic script's figures and where the seconds went
        "classic": {
            "args": classic.ARGS,
            "figures": [f.to_json() for f in classic_figures],
            "owner": classic.OWNER,
            "breakdown": split,
        }
        if unchanged
        else None,
        "sharded": {
            "args": {
                "faults": sharded.ARGS,
                "hsdp": sharded.HSDP_ARGS,
                "throughput": sharded.THROUGHPUT_ARGS,
            },
            "window": sharded.WINDOW,
            "figures": [f.to_json() for f in sharded_figures],
            "throughput_runs": [asdict(t) for t in sharded_runs],
        }
        if sharded_faults or sharded_steady
        else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M")
    text = json.dumps(doc, indent=2) + "\n"
    (args.out / "latest.json").write_text(text)
    (args.out / f"{stamp}.json").write_text(text)
    for scenario in ("goodput", "gpt-goodput"):
        runs = [g for g in goodputs if g.scenario == scenario]
        if runs:
            title = (
                "train_gpt.py (ours) and gpt_plain.py (torchrun) through a worker SIGKILL "
                f"every {GOODPUT_INTERVAL:.0f} s"
                if scenario == "gpt-goodput"
                else None
            )
            path = args.out / f"{stamp}-{scenario}.png"
            print(f"plot: {plot_goodput(runs, path, *([title] if title else []))}")
    print(f"\nwritten: {args.out / 'latest.json'} and {stamp}.json ({doc['seconds_total']} s)")


if __name__ == "__main__":
    main()
