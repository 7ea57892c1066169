"""Where a recovery's time goes, read from the logs both launchers write (pure functions).

Both launchers run torch's elastic agent, which logs ``[role] Stopping worker group``
when it reacts to a fault (ours logs ``regrouping the running workers in place`` instead
when its workers use the training-loop API and stay alive) and ``[role] Starting worker
group`` once the new round is agreed; the example logs its start-up phases
(``startup=...(imports=.., process_group=.., ddp=.., restore=..)``) and every step.
From those:

* **detect**: the fault -> the first agent stopping its workers;
* **rendezvous**: -> the last agent starting its workers (old workers stopped, new
  round agreed);
* **worker ready**: -> the new worker started and imported (process start or warm-spare
  hand-over, imports);
* **process group**: -> process group and DDP built;
* **restore**: -> checkpoint restored;
* **first step**: -> the first training step done.

A script without the ``startup=`` line (examples/train_gpt.py and bench/gpt_plain.py)
gets the coarser :func:`coarse_breakdown`: detect and rendezvous as above, then
**ready** (-> the last new or regrouped worker logs ``started (...)`` or ``regrouped at
step``: process group, state from a peer or a checkpoint, DDP, the agreement check) and
**first step** (-> the first step: the DataLoader refilling its prefetch, the step and
the check after it); a script that logs neither (gpt_plain.py) has no *ready*, and its
*first step* covers everything after the rendezvous (interpreter, imports, process
group, checkpoint, DDP, DataLoader workers, the step).

A script that logs ``startup phase=<name> pid=<pid> t=<unix>`` at each of its start-up
marks (bench/classic_imagenet.py: :data:`SCRIPT_MARKS`) gets :func:`classic_breakdown`
(:data:`CLASSIC`): detect and rendezvous as above, then **worker start** (-> the script's
``imports`` mark: the process exec, or a warm spare's hand-over, and the script's
imports), then one phase per mark of the script's own (``process_group``, ``model``,
``checkpoint``, ``ddp``, ``loader``: its DataLoader workers forked and the first batch
in), then **first step** (-> rank 0's first step). Each mark is the last new worker's:
the ranks meet in the process group, DDP's broadcast and the first all-reduce, so the
slowest rank sets the pace.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

# torch's glog-style prefix: I1122 12:17:33.560000 22150 torch/...py:123] message
_TORCH_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] (.*)$")
_STARTUP = re.compile(
    r"\bstartup=([0-9.]+)s\(imports=([0-9.]+),process_group=([0-9.]+),ddp=([0-9.]+),"
    r"restore=([0-9.]+)\).*\bt=([0-9.]+)\s*$"
)
# ours: [2026-11-22 16:31:14,319] elasticjob_runtime.launch.agent: regrouping the running workers...
_OUR_LINE = re.compile(r"^\[(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d),(\d{3})\] \S+: (.*)$")
PHASES = ("detect", "rendezvous", "worker_ready", "process_group", "restore", "first_step")
COARSE = ("detect", "rendezvous", "ready", "first_step")  # coarse_breakdown's phases
# examples/train_gpt.py: a worker's Run is ready (after run.wrap), or it regrouped in place
_READY = re.compile(r"^(?:started \(|regrouped at step \d+ ).*\bt=([0-9.]+)\s*$")
# bench/classic_imagenet.py: startup phase=<name> pid=<pid> t=<unix>, in this order
SCRIPT_MARKS = ("imports", "process_group", "model", "checkpoint", "ddp", "loader")
_SCRIPT_MARK = re.compile(r"^startup phase=(\w+) pid=(\d+) t=([0-9.]+)\s*$")
CLASSIC = ("detect", "rendezvous", "worker_start", *SCRIPT_MARKS[1:], "first_step")
_ROUNDING = 0.002  # the script's t= has milliseconds, torch's log microseconds


@dataclass(frozen=True)
class AgentEvent:
    t: float  # unix seconds
    what: str  # "stopping" or "starting"


@dataclass(frozen=True)
class Startup:
    """A worker's start-up line: when it was restored (``t``) and how long each part took."""

    t: float
    total: float
    imports: float
    process_group: float  # process group and DDP
    restore: float


def agent_events(lines: Iterable[str], year: int) -> list[AgentEvent]:
    """torch agent's stop/start of its worker group, with their (local-time) timestamps."""
    found = []
    for line in lines:
        ours = _OUR_LINE.match(line)
        if ours is not None:
            if "regrouping the running workers in place" in ours.group(8):
                y, mo, d, h, mi, sec, ms = (int(ours.group(i)) for i in range(1, 8))
                whole = time.mktime((y, mo, d, h, mi, sec, 0, 0, -1))
                found.append(AgentEvent(whole + ms / 1000, "stopping"))
            continue
        m = _TORCH_LINE.match(line)
        if m is None:
            continue
        message = m.group(6)
        what = (
            "stopping"
            if "Stopping worker group" in message
            else "starting"
            if "Starting worker group" in message
            else None
        )
        if what is None:
            continue
        month, day, hour, minute = (int(m.group(i)) for i in range(1, 5))
        seconds = float(m.group(5))
        whole = time.mktime((year, month, day, hour, minute, 0, 0, 0, -1))
        found.append(AgentEvent(whole + seconds, what))
    return found


def startups(lines: Iterable[str]) -> list[Startup]:
    found = []
    for line in lines:
        m = _STARTUP.search(line)
        if m is not None:
            total, imports, pg, ddp, restore, t = (float(g) for g in m.groups())
            found.append(Startup(t, total, imports, pg + ddp, restore))
    return found


def breakdown(
    fault: float,
    per_agent: Sequence[list[AgentEvent]],
    startup: Startup | None,
    first_step: float,
) -> dict[str, float] | None:
    """The phases of one recovery (seconds each), or None when a mark is missing."""
    stops = [e.t for events in per_agent for e in events if e.what == "stopping" and e.t >= fault]
    if not stops or startup is None:
        return None
    detected = min(stops)
    starts = []
    for events in per_agent:
        mine = [e.t for e in events if e.what == "starting" and detected <= e.t <= startup.t]
        if mine:
            starts.append(min(mine))
    if not starts:
        return None
    agreed = max(starts)
    imported = startup.t - startup.restore - startup.process_group
    phases = {
        "detect": detected - fault,
        "rendezvous": agreed - detected,
        "worker_ready": imported - agreed,
        "process_group": startup.process_group,
        "restore": startup.restore,
        "first_step": first_step - startup.t,
    }
    # log timestamps are milliseconds apart: a phase of ~0 may read a hair below it
    return {k: round(max(v, 0.0), 3) for k, v in phases.items()}


def ready_marks(lines: Iterable[str]) -> list[float]:
    """When a worker said it was ready to train: ``started (...) ... t=`` after
    ``run.wrap`` or ``regrouped at step N ... t=`` after a regroup in place."""
    found = []
    for line in lines:
        m = _READY.match(line.strip())
        if m is not None:
            found.append(float(m.group(1)))
    return sorted(found)


def coarse_breakdown(
    fault: float,
    per_agent: Sequence[list[AgentEvent]],
    ready: float | None,
    first_step: float,
) -> dict[str, float] | None:
    """The phases (:data:`COARSE`) of one recovery of a script without a ``startup=``
    line: ``ready`` is the last worker's ready mark (None: it logs none, and ``ready``
    is left out, its time counted in ``first_step``). None when no agent reacted."""
    stops = [e.t for events in per_agent for e in events if e.what == "stopping" and e.t >= fault]
    if not stops:
        return None
    detected = min(stops)
    until = first_step if ready is None else ready
    starts = []
    for events in per_agent:
        mine = [e.t for e in events if e.what == "starting" and detected <= e.t <= until]
        if mine:
            starts.append(min(mine))
    if not starts:
        return None
    agreed = max(starts)
    phases = {"detect": detected - fault, "rendezvous": agreed - detected}
    if ready is not None:
        phases["ready"] = ready - agreed
    phases["first_step"] = first_step - (agreed if ready is None else ready)
    return {k: round(max(v, 0.0), 3) for k, v in phases.items()}


def script_marks(lines: Iterable[str]) -> dict[int, dict[str, float]]:
    """pid -> mark -> unix time, from the ``startup phase=<mark> pid= t=`` lines a worker
    prints as it starts (a mark a pid logs twice keeps the later time)."""
    found: dict[int, dict[str, float]] = {}
    for line in lines:
        m = _SCRIPT_MARK.match(line.strip())
        if m is not None:
            found.setdefault(int(m.group(2)), {})[m.group(1)] = float(m.group(3))
    return found


def classic_breakdown(
    fault: float,
    per_agent: Sequence[tuple[Sequence[AgentEvent], Mapping[int, Mapping[str, float]]]],
    first_step: float,
) -> dict[str, float] | None:
    """The phases (:data:`CLASSIC`) of one recovery of a script that logs its start-up
    marks: ``per_agent`` is each agent's events and its workers' marks
    (:func:`script_marks` of its log), ``first_step`` when rank 0 finished the first step
    after the fault. The new round is each agent's last start of its workers between the
    first reaction and that step; its workers are those whose ``imports`` came after that
    start and who had every mark by the step. None when no agent reacted, none started
    workers, or no such worker logged its marks."""
    stops = [
        e.t
        for events, _ in per_agent
        for e in events
        if e.what == "stopping" and fault <= e.t <= first_step
    ]
    if not stops:
        return None
    detected = min(stops)
    starts: list[float] = []
    workers: list[Mapping[str, float]] = []
    for events, marks in per_agent:
        mine = [e.t for e in events if e.what == "starting" and detected <= e.t <= first_step]
        if not mine:
            continue  # a lost node's agent, or one that kept its workers
        started = max(mine)
        starts.append(started)
        workers += [
            m
            for m in marks.values()
            if all(name in m for name in SCRIPT_MARKS)
            and started - _ROUNDING <= m["imports"]
            and m["loader"] <= first_step
        ]
    if not starts or not workers:
        return None
    agreed = max(starts)
    last = {name: max(m[name] for m in workers) for name in SCRIPT_MARKS}
    phases = {"detect": detected - fault, "rendezvous": agreed - detected}
    phases["worker_start"] = last["imports"] - agreed
    for before, name in pairwise(SCRIPT_MARKS):
        phases[name] = last[name] - last[before]
    phases["first_step"] = first_step - last["loader"]
    # log timestamps are milliseconds apart: a phase of ~0 may read a hair below it
    return {k: round(max(v, 0.0), 3) for k, v in phases.items()}
