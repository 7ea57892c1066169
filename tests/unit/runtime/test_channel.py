"""The agent-worker channel: each round's assignment reaches its workers, and their
answers reach the agent."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elasticjob_runtime import contract
from elasticjob_runtime.launch.channel import (
    DIR_PREFIX,
    AgentChannel,
    Assignment,
    StepReporter,
    WorkerChannel,
    group_broken,
    new_channel_dir,
    pid_namespace,
    sweep_abandoned,
)
from elasticjob_runtime.launch.wakeup import drain

ENV = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}


def test_an_assignment_round_trips_and_names_its_round() -> None:
    a = Assignment(4, dict(ENV), abort=True)
    back = Assignment.from_json(a.to_json())
    assert back == a
    assert (back.rank, back.world_size, back.master) == (1, 3, ("10.0.0.7", 29500))
    other = Assignment(5, {**ENV, "MASTER_PORT": "29501"})
    assert a.store_prefix() != other.store_prefix()
    assert Assignment(9, dict(ENV)).store_prefix() == a.store_prefix()  # same round, any agent


def test_a_worker_sees_each_newer_assignment_and_waits_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = AgentChannel(tmp_path)
    monkeypatch.setenv(contract.AGENT_CHANNEL, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    worker = WorkerChannel.from_env()
    assert worker is not None and worker.latest() is None
    agent.deliver(1, {0: {**ENV, "RANK": "0"}, 1: ENV}, abort=False)
    first = worker.latest()
    assert first is not None and (first.generation, first.rank, first.abort) == (1, 1, False)
    assert worker.wait_newer(1, timeout=0.05) is None

    later = threading.Timer(0.1, lambda: agent.deliver(2, {1: {**ENV, "RANK": "2"}}, abort=True))
    later.start()
    found = worker.wait_newer(1, timeout=10)
    later.join()
    assert found is not None and (found.generation, found.rank, found.abort) == (2, 2, True)


def test_outside_elasticjob_run_there_is_no_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.AGENT_CHANNEL, raising=False)
    assert WorkerChannel.from_env() is None
    monkeypatch.setenv(contract.AGENT_CHANNEL, "/nonexistent/elasticjob")
    assert WorkerChannel.from_env() is None


def test_the_agent_reads_offers_and_regroup_requests_for_the_running_round(
    tmp_path: Path,
) -> None:
    agent = AgentChannel(tmp_path)
    workers = [WorkerChannel(tmp_path, rank) for rank in (0, 1)]
    for w in workers:
        w.offer_in_place()
    assert agent.in_place_pids() == {0: os.getpid(), 1: os.getpid()}
    workers[1].request_regroup(3)
    assert agent.regroup_requested(3)
    assert not agent.regroup_requested(4)  # a request from an older round is stale
    agent.forget_workers()
    assert agent.in_place_pids() == {}


def test_a_regroup_and_a_worker_finishing_each_see_the_other_first(tmp_path: Path) -> None:
    agent = AgentChannel(tmp_path)
    worker = WorkerChannel(tmp_path, 0)
    # The agent marked first: the finishing worker sees a round coming and waits for it.
    assert agent.begin_regroup()
    worker.say_finished()
    assert worker.agent_regrouping()
    agent.end_regroup()
    assert not worker.agent_regrouping()  # delivered: the worker may go
    # The worker said it finished first: the agent does not count on it to regroup.
    assert not agent.begin_regroup()
    assert not worker.agent_regrouping()
    agent.forget_workers()  # restarted workers have not finished
    assert agent.begin_regroup()
    agent.end_regroup()


def test_workers_report_steps_the_agent_reads_until_they_are_replaced(tmp_path: Path) -> None:
    agent = AgentChannel(tmp_path)
    a, b = StepReporter(tmp_path, 0), StepReporter(tmp_path, 1)
    a.report(1000)
    a.report(3)  # a shorter number leaves no digits of the longer one behind
    b.report(4)
    (tmp_path / "step-x").write_text("garbage")  # not a worker's report
    assert agent.steps() == {0: 3, 1: 4}
    agent.forget_workers()
    assert agent.steps() == {}
    a.report(5)  # a worker still running when its report was removed: nobody reads it
    a.close()
    b.close()


def test_a_step_reporter_only_under_elasticjob_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(contract.AGENT_CHANNEL, raising=False)
    assert StepReporter.from_env() is None
    monkeypatch.setenv(contract.AGENT_CHANNEL, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "2")
    reporter = StepReporter.from_env()
    assert reporter is not None and reporter.path == tmp_path / "step-2"


def test_a_step_reporter_whose_agent_is_gone_stays_quiet(tmp_path: Path) -> None:
    StepReporter(tmp_path / "gone", 0).report(1)  # no error


def test_workers_learn_through_the_channel_that_their_group_broke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(contract.AGENT_CHANNEL, raising=False)
    assert not group_broken()  # no agent: nobody to say so
    monkeypatch.setenv(contract.AGENT_CHANNEL, str(tmp_path))
    agent = AgentChannel(tmp_path)
    assert not group_broken()
    agent.mark_group_broken()
    assert group_broken()
    agent.clear_group_broken()
    assert not group_broken()


def test_a_delivery_rings_the_bell_of_each_worker_that_holds_it_open(tmp_path: Path) -> None:
    agent = AgentChannel(tmp_path)
    agent.deliver(1, {0: ENV, 1: ENV}, abort=False)  # nobody holds a bell yet: no error, no wait
    bell = WorkerChannel(tmp_path, 1).bell()
    assert bell is not None
    try:
        assert not _readable(bell)
        agent.deliver(2, {0: ENV, 1: ENV}, abort=False)
        assert _readable(bell)
        drain(bell)
        assert not _readable(bell)
        fcntl.fcntl(bell, fcntl.F_SETPIPE_SZ, 4096)  # a page: full after 4096 rings
        for generation in range(3, 5000):  # a full FIFO never blocks the agent
            agent.deliver(generation, {1: ENV}, abort=False)
        assert _readable(bell)
        assert len(os.read(bell, 65536)) == 4096  # it was full: the later rings were dropped
    finally:
        os.close(bell)
    agent.deliver(300, {1: ENV}, abort=False)  # its worker gone: nobody reads, nothing blocks
    again = WorkerChannel(tmp_path, 1).bell()  # a later worker of the rank opens the same FIFO
    assert again is not None
    os.close(again)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_the_next_agent_removes_the_channel_directories_of_killed_agents(tmp_path: Path) -> None:
    ns = pid_namespace()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f"{DIR_PREFIX}{ns}-{dead.pid}-abc",
            "live": f"{DIR_PREFIX}{ns}-{live.pid}-def",
            "mine": f"{DIR_PREFIX}{ns}-{os.getpid()}-ghi",
            # a container sharing /tmp with its own pid namespace: its pids mean nothing here
            "other namespace": f"{DIR_PREFIX}{ns + 1}-{dead.pid}-jkl",
            "old name": f"{DIR_PREFIX}x1y2z3",
            "not ours": f"other-{ns}-{dead.pid}-mno",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "assignment-0.json").write_text("{}")
        assert sweep_abandoned(tmp_path) == [names["dead"]]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            n for k, n in names.items() if k != "dead"
        )
    finally:
        live.kill()
        live.wait()


def test_a_new_channel_directory_is_named_so_that_a_sweep_can_judge_it() -> None:
    made = new_channel_dir()
    try:
        assert made.name.startswith(f"{DIR_PREFIX}{pid_namespace()}-{os.getpid()}-")
        assert sweep_abandoned(made.parent).count(made.name) == 0  # its agent lives
    finally:
        made.rmdir()
