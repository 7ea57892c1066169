"""Real agents (elasticjob-run / torchrun) and real gloo workers against a real etcd.

Each test starts its launchers in their own sessions, records their pids, and kills
exactly those process trees at the end. Bounds are generous (the machine is shared);
the recovery figures they print belong to the benchmark, not to these asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import WORKERS, EtcdServer, free_port, launcher_argv, start_etcd

from bench.harness import wait_for as poll
from elasticjob_devcluster.procs import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAIN = WORKERS / "rdzv_train.py"
T = TypeVar("T")


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def kill_node(self) -> None:
        """SIGKILL the agent and its workers together, as when a node is lost."""
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP the agent and its workers: a node that vanishes without closing a socket."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_node()

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} ---\n" + "\n".join(text.splitlines()[-25:])


class Job:
    """One run id, its output directory, and the agents started for it."""

    def __init__(self, etcd: EtcdServer, workdir: Path, steps: int, pause: float = 0.15) -> None:
        self.etcd = etcd
        self.run_id = f"test-{uuid.uuid4().hex[:8]}"
        self.out = workdir
        self.steps = steps
        self.pause = pause
        self.agents: list[Agent] = []

    def start(
        self,
        nnodes: str,
        launcher: list[str] | None = None,
        max_restarts: int = 3,
        backend: str = "etcd-v3",
        endpoint: str | None = None,
    ) -> Agent:
        name = f"agent{len(self.agents)}"
        log = self.out / f"{name}.log"
        cmd = launcher_argv(
            endpoint or self.etcd.endpoint,
            self.run_id,
            [str(TRAIN)],
            nnodes=nnodes,
            max_restarts=max_restarts,
            backend=backend,
            launcher=launcher,
        )
        env = {
            **os.environ,
            "RDZV_TEST_OUT": str(self.out),
            "RDZV_TEST_STEPS": str(self.steps),
            "RDZV_TEST_PAUSE": str(self.pause),
            "LOGLEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        agent = Agent(name, proc, log)
        self.agents.append(agent)
        return agent

    def lines(self) -> list[dict[str, Any]]:
        path = self.out / "steps.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait_for(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        try:
            return poll(what, check, timeout)
        except TimeoutError as exc:
            logs = "\n".join(a.tail() for a in self.agents)
            pytest.fail(f"{exc}\n{logs}")

    def wait_exit(self, agents: list[Agent], timeout: float) -> list[int]:
        codes = self.wait_for(
            "the agents to finish",
            lambda: (
                [a.proc.returncode for a in agents]
                if all(a.proc.poll() is not None for a in agents)
                else None
            ),
            timeout,
        )
        return codes

    def finish_after(
        self, steps: int, pred: Callable[[dict[str, Any]], bool], timeout: float
    ) -> None:
        """Once ``steps`` more steps matching ``pred`` are logged, ask the job to end."""
        self.wait_for(
            f"{steps} steps",
            lambda: True if len({s["step"] for s in self.lines() if pred(s)}) >= steps else None,
            timeout,
        )
        (self.out / "stop").touch()

    def first(self, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((line for line in self.lines() if pred(line)), None)


@pytest.fixture
def job_factory(etcd: EtcdServer, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(steps: int, pause: float = 0.15) -> Job:
        job = Job(etcd, tmp_path / f"job{len(jobs)}", steps, pause)
        job.out.mkdir()
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        for agent in job.agents:
            agent.stop()


def assert_every_step_saw_its_world(job: Job) -> None:
    bad = [line for line in job.lines() if line["seen"] != line["world"]]
    assert not bad, f"ranks disagreed on the world size: {bad[:3]}"


def test_three_agents_one_killed_the_other_two_continue_at_world_size_two(
    job_factory: Callable[..., Job],
) -> None:
    job = job_factory(100_000)
    for _ in range(3):
        job.start("2:3", max_restarts=0)
    job.wait_for(
        "3 nodes training", lambda: job.first(lambda s: s["world"] == 3 and s["step"] >= 5), 180
    )

    victim = job.agents[2]
    killed_at = time.time()
    victim.kill_node()
    resumed = job.wait_for(
        "the survivors to train at world size 2",
        lambda: job.first(lambda s: s["t"] > killed_at and s["world"] == 2),
        60,
    )
    recovery = resumed["t"] - killed_at
    print(f"\nkilled agent -> training again at world size 2 after {recovery:.1f}s")
    assert recovery < 30

    job.finish_after(5, lambda s: s["t"] >= resumed["t"], 120)
    survivors = job.agents[:2]
    assert job.wait_exit(survivors, 240) == [0, 0]
    before = [s["step"] for s in job.lines() if s["t"] < killed_at]
    after = [s for s in job.lines() if s["t"] >= resumed["t"]]
    assert {s["world"] for s in after} == {2}
    assert min(s["step"] for s in after) >= max(before) - 1, "training restarted from scratch"
    assert_every_step_saw_its_world(job)


def test_a_worker_failure_caused_by_a_lost_peer_spends_no_restart(
    job_factory: Callable[..., Job],
) -> None:
    # No restarts to spend: the survivor's worker fails (as gloo does when a peer
    # dies mid-collective) just before the peer's lease runs out. Stock torch would
    # charge that to this node and, with none left, end the job.
    job = job_factory(100_000)
    for _ in range(3):
        job.start("2:3", max_restarts=0)
    job.wait_for(
        "3 nodes training", lambda: job.first(lambda s: s["world"] == 3 and s["step"] >= 5), 180
    )
    survivor_workers = descendants(job.agents[0].proc.pid)
    assert survivor_workers
    failed_at = time.time()
    for pid in survivor_workers:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.1)
    job.agents[2].kill_node()
    job.wait_for(
        "the survivors to train at world size 2",
        lambda: job.first(lambda s: s["t"] > failed_at and s["world"] == 2),
        60,
    )
    job.finish_after(3, lambda s: s["t"] > failed_at and s["world"] == 2, 120)
    assert job.wait_exit(job.agents[:2], 240) == [0, 0]
    assert "not counted as a restart" in job.agents[0].log.read_text()


def test_a_node_that_vanishes_silently_is_dropped_in_seconds_not_a_collective_timeout(
    job_factory: Callable[..., Job],
) -> None:
    # The survivors' gloo peers never see a reset connection, so without the lease
    # they would sit in all_reduce until the collective timeout (pytorch#111646).
    job = job_factory(100_000)
    for _ in range(3):
        job.start("2:3")
    job.wait_for(
        "3 nodes training", lambda: job.first(lambda s: s["world"] == 3 and s["step"] >= 5), 180
    )

    frozen_at = time.time()
    job.agents[2].freeze()
    resumed = job.wait_for(
        "the survivors to train at world size 2",
        lambda: job.first(lambda s: s["t"] > frozen_at and s["world"] == 2),
        60,
    )
    print(f"\nfrozen node -> training again at world size 2 after {resumed['t'] - frozen_at:.1f}s")
    assert resumed["t"] - frozen_at < 30
    job.finish_after(5, lambda s: s["t"] >= resumed["t"], 120)
    assert job.wait_exit(job.agents[:2], 240) == [0, 0]
    assert {s["world"] for s in job.lines() if s["t"] >= resumed["t"]} == {2}
    assert_every_step_saw_its_world(job)


def test_an_agent_started_mid_run_joins_and_the_world_grows(
    job_factory: Callable[..., Job],
) -> None:
    job = job_factory(100_000)
    job.start("2:3")
    job.start("2:3")
    job.wait_for(
        "2 nodes training", lambda: job.first(lambda s: s["world"] == 2 and s["step"] >= 5), 180
    )

    started_at = time.time()
    newcomer = job.start("2:3")
    grown = job.wait_for(
        "the world to grow to 3",
        lambda: job.first(lambda s: s["t"] > started_at and s["world"] == 3),
        90,
    )
    print(f"\nlate joiner -> training at world size 3 after {grown['t'] - started_at:.1f}s")

    job.finish_after(5, lambda s: s["t"] >= grown["t"], 120)
    assert job.wait_exit(job.agents, 240) == [0, 0, 0]
    assert newcomer.proc.pid in {s["agent"] for s in job.lines() if s["world"] == 3}
    assert {s["world"] for s in job.lines() if s["t"] >= grown["t"]} == {3}
    assert_every_step_saw_its_world(job)


def test_a_node_that_comes_after_training_finished_exits_0_saying_so(
    job_factory: Callable[..., Job],
) -> None:
    """A scale-up pod started as the job ends must not fail the job that succeeded."""
    job = job_factory(5)
    job.start("1:2")
    assert job.wait_exit(job.agents, 180) == [0]
    late = job.start("1:2")
    assert job.wait_exit([late], 120) == [0], late.tail()
    assert "finished training before this node joined" in late.log.read_text()
    assert late.proc.pid not in {s["agent"] for s in job.lines()}


def test_a_killed_worker_restarts_the_group_which_resumes_where_it_stopped(
    job_factory: Callable[..., Job],
) -> None:
    job = job_factory(100_000)
    job.start("2:2")
    job.start("2:2")
    job.wait_for(
        "2 nodes training", lambda: job.first(lambda s: s["world"] == 2 and s["step"] >= 5), 180
    )

    workers = descendants(job.agents[0].proc.pid)
    assert workers, "the agent has no worker process"
    killed_at = time.time()
    last_step = max(s["step"] for s in job.lines())
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    again = job.wait_for(
        "the group to train again after a restart",
        lambda: job.first(lambda s: s["t"] > killed_at and s["restart"] >= 1),
        60,
    )
    print(f"\nkilled worker -> training again after {again['t'] - killed_at:.1f}s")
    assert again["step"] >= last_step - 1, "the restarted group did not resume"
    job.finish_after(5, lambda s: s["t"] >= again["t"], 120)
    assert job.wait_exit(job.agents, 240) == [0, 0]
    # Only the node whose worker died spends a restart; its peer merely regrouped.
    after = [s for s in job.lines() if s["t"] >= again["t"]]
    origin, peer = job.agents[0].proc.pid, job.agents[1].proc.pid
    assert {s["restart"] for s in after if s["agent"] == origin} == {1}
    assert {s["restart"] for s in after if s["agent"] == peer} == {0}


def test_plain_torchrun_runs_a_two_node_job_on_etcd_v3(job_factory: Callable[..., Job]) -> None:
    job = job_factory(8)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    job.start("2", launcher=torchrun, max_restarts=0)
    job.start("2", launcher=torchrun, max_restarts=0)
    assert job.wait_exit(job.agents, 180) == [0, 0]
    lines = job.lines()
    assert {(s["rank"], s["world"]) for s in lines} == {(0, 2), (1, 2)}
    assert max(s["step"] for s in lines) == 7


def run_launcher(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    return subprocess.run(
        [sys.executable, "-m", "elasticjob_runtime.launch.launcher", *args, str(TRAIN)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("elasticjob-run:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_bad_configuration_exits_with_one_clear_line(etcd: EtcdServer) -> None:
    base = [f"--rdzv-endpoint={etcd.endpoint}", "--rdzv-id=bad-config"]

    line = one_error_line(run_launcher("--nnodes=3:2", *base))
    assert "min (3) is greater than max (2)" in line

    # The flag wins over the variable the operator injects; the variable alone is read too.
    line = one_error_line(run_launcher("--nnodes=3:2", *base, env={"PET_NNODES": "1:2"}))
    assert "3:2" in line
    line = one_error_line(run_launcher(*base, env={"PET_NNODES": "4:1"}))
    assert "min (4) is greater than max (1)" in line

    line = one_error_line(run_launcher("--nnodes=1:2", "--rdzv-backend=zookeeper", *base))
    assert "unknown rendezvous backend 'zookeeper'" in line and "etcd-v3" in line

    dead = f"127.0.0.1:{free_port()}"
    line = one_error_line(
        run_launcher("--nnodes=1:2", f"--rdzv-endpoint={dead}", "--rdzv-id=bad-config")
    )
    assert f"cannot reach etcd at {dead}" in line


def test_in_a_pod_the_launcher_waits_for_a_job_etcd_that_starts_later(tmp_path: Path) -> None:
    """The operator creates a job's etcd and its workers at once; a worker that starts first
    must wait for the store, not exit (each exit costs a pod replacement from backoffLimit)."""
    server = start_etcd("3.5", tmp_path / "etcd")
    server.stop()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env = {
        **clean,
        "ELASTICJOB_POD_NAME": "late-worker-0",
        "ELASTICJOB_HEALTH_PORT": "0",  # its probes on any free port, not the pod's 8090
        "RDZV_TEST_OUT": str(tmp_path),
        "RDZV_TEST_STEPS": "2",
        "RDZV_TEST_PAUSE": "0",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elasticjob_runtime.launch.launcher",
            "--nnodes=1",
            f"--rdzv-endpoint={server.endpoint}",
            f"--rdzv-id=late-{uuid.uuid4().hex[:6]}",
            str(TRAIN),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        time.sleep(8)
        assert proc.poll() is None, proc.communicate()[1]  # still waiting, not failed
        server.restart()
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert "waiting up to" in err and "cannot reach etcd" in err
        assert (tmp_path / "steps.jsonl").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        server.stop()
