"""Survivors that stay alive: the training-loop API under the real launcher, real etcd,
real torch workers over gloo.

A peer that dies, joins or freezes changes the round; the workers whose own process is
healthy keep their pid and their memory, drop at most the step in flight, and a new
worker gets the state from a survivor. Compared with the restart path
(``ELASTICJOB_IN_PLACE=0``), the same fault trains the same model, and every sample is
still seen exactly once per epoch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import (
    WORKERS,
    EtcdServer,
    read_progress,
    result_of,
    start,
    still_running,
    wait_for,
)
from elasticjob_examples import sample_audit

from elasticjob_devcluster.procs import descendants
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CRASH_ONCE = WORKERS / "crash_once.py"
LINGER_AT_END = WORKERS / "linger_at_end.py"
SAMPLES = 1024  # small, so that the runs cross epoch boundaries and resizes


def train_args(ckpt: Path, steps: int, *extra: str) -> list[str]:
    return [
        str(CRASH_ONCE),
        f"--steps={steps}",
        f"--samples={SAMPLES}",
        "--batch-size=8",
        "--checkpoint-interval=10",
        "--log-every=1",
        "--log-ranks=all",
        "--log-samples=1",
        f"--checkpoint-dir={ckpt}",
        *extra,
    ]


def steps_by_pid(text: str) -> dict[int, list[int]]:
    """Worker pid -> the steps it logged."""
    found: dict[int, list[int]] = {}
    for step, pid in re.findall(r"^step=(\d+) .* pid=(\d+) ", text, re.M):
        found.setdefault(int(pid), []).append(int(step))
    return found


def pids_throughout(text: str, last: int) -> set[int]:
    """Workers that logged the first step and step ``last``: they never restarted."""
    return {pid for pid, steps in steps_by_pid(text).items() if steps[0] == 1 and last in steps}


def assert_exactly_once(text: str, steps: int, world_history: str) -> None:
    """Every step one full group that committed, every index once per epoch, and every
    finished epoch covered whole (sample_audit.py)."""
    found = sample_audit.audit(sample_audit.parse_all(text.splitlines()), SAMPLES, steps)
    assert found.epochs, f"no sample lines ({world_history})"
    assert not found.problems, f"{found.problems} ({world_history})"


def two_nodes(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path, nnodes: str
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """Two agents of one worker each (checkpoints in ``tmp / "ckpt"``), training until
    stopped, once they train at world size 2."""
    run_id = f"two-{uuid.uuid4().hex[:8]}"
    logs = [tmp / "a.log", tmp / "b.log"]
    args = train_args(tmp / "ckpt", 1_000_000, "--sleep=0.05", "--epochs=1000")
    env = {"CRASH_AT_STEP": "-1", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off"}
    procs = [
        start(agents, etcd, log, args, nnodes=nnodes, nproc=1, run_id=run_id, env=env)
        for log in logs
    ]
    wait_for(
        "training at world size 2",
        lambda: True if re.search(r"^step=2\d .*world=2 ", logs[0].read_text(), re.M) else None,
        180,
        logs[0],
    )
    return procs, logs


def run_crash(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path, in_place: bool
) -> tuple[str, str]:
    """Two agents with two workers each; global rank 1 SIGKILLs itself after step 25.
    Returns the agents' logs and the workers' output."""
    run_id = f"inplace-{uuid.uuid4().hex[:8]}"
    env = {
        "CRASH_AT_STEP": "25",
        "ELASTICJOB_IN_PLACE": "1" if in_place else "0",
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp / "shm"),
    }
    procs, logs = [], []
    for node in ("a", "b"):
        log = tmp / f"agent-{node}.log"
        procs.append(
            start(
                agents,
                etcd,
                log,
                train_args(tmp / f"ckpt-{node}", 80),
                nnodes="2",
                nproc=2,
                max_restarts=1,
                run_id=run_id,
                # A file per worker: two `python -u` workers sharing one stream can
                # split each other's lines (print writes the text and the newline apart).
                launcher_flags=("--redirects=3", f"--log-dir={tmp / f'logs-{node}'}"),
                env={**env, "ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(tmp / f"shm-{node}")},
            )
        )
        logs.append(log)
    for proc, log in zip(procs, logs, strict=True):
        wait_for("the job to finish", lambda p=proc: p.poll(), 300, log)
        assert proc.returncode == 0, log.read_text()[-4000:]
    workers = sorted(tmp.glob("logs-*/**/stdout.log"))
    assert len(workers) == 6, workers  # 2 + 2 first, 2 restarted on the node that lost one
    return "\n".join(log.read_text() for log in logs), "\n".join(w.read_text() for w in workers)


def test_a_dead_peer_leaves_the_survivors_running_and_the_model_matches_a_restart(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    (tmp_path / "in-place").mkdir()
    (tmp_path / "restart").mkdir()
    _, in_place = run_crash(agents, etcd, tmp_path / "in-place", in_place=True)
    _, restart = run_crash(agents, etcd, tmp_path / "restart", in_place=False)

    # The node that lost rank 1 restarted both its workers (a local fault); the other
    # node's two workers regrouped at step 25: nothing redone, nothing read from disk.
    regrouped = re.findall(r"^regrouped at step (\d+) \(([^)]*)\)", in_place, re.M)
    assert len(regrouped) == 2, in_place[-4000:]
    assert {int(step) for step, _ in regrouped} == {25}
    resumed = re.findall(r"^resumed from step (\d+) \((rank \d+ at step \d+)\)", in_place, re.M)
    assert len(resumed) == 2 and {int(s) for s, _ in resumed} == {25}, in_place[-4000:]
    assert len(pids_throughout(in_place, 80)) == 2, steps_by_pid(in_place).keys()
    assert "regrouped" not in restart
    assert not pids_throughout(restart, 80)

    # Same seed, same fault, same world history: the same model either way.
    ours, theirs = result_of(in_place), result_of(restart)
    for doc in (ours, theirs):
        del doc["regroups"], doc["restarts"]  # how it got there differs, not where
    assert ours == theirs
    assert_exactly_once(in_place, 80, "2x2, rank 1 died at step 25, regrouped in place")


def test_a_joining_node_switches_the_running_group_without_restarting_it(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"join-{uuid.uuid4().hex[:8]}"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    # Epochs without end: on a busy machine the newcomer's spares may take most of a
    # minute to import torch, and the job must still be running when it arrives.
    args = train_args(tmp_path / "ckpt", 1_000_000, "--sleep=0.05", "--epochs=1000")
    env = {
        "CRASH_AT_STEP": "-1",
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off",
        "PET_RDZV_ENDPOINT": etcd.endpoint,  # rank 0 publishes progress there
    }
    first = start(agents, etcd, first_log, args, nnodes="1:2", nproc=1, run_id=run_id, env=env)
    wait_for(
        "training", lambda: True if "step=30 " in first_log.read_text() else None, 180, first_log
    )
    start(agents, etcd, second_log, args, nnodes="1:2", nproc=1, run_id=run_id, env=env)
    wait_for(
        "training at world size 2",
        lambda: (
            True
            if re.search(
                r"^step=\d+ .*world=2 .*rank=1 ",
                second_log.read_text() + first_log.read_text(),
                re.M,
            )
            else None
        ),
        180,
        second_log,
    )
    text = first_log.read_text()
    # One process all along on the first node, which switched at a step boundary (or
    # dropped the one step in flight) and handed its state to the newcomer.
    assert len(steps_by_pid(text)) == 1, text[-3000:]
    (at,) = re.findall(r"^regrouped at step (\d+) ", text, re.M)
    last_before = max(int(s) for s in re.findall(r"^step=(\d+) .*world=1 ", text, re.M))
    assert int(at) >= last_before - 1  # at most the step in flight redone
    newcomer = second_log.read_text()
    assert re.search(rf"^resumed from step {at} \(rank \d at step {at}\)", newcomer, re.M), (
        newcomer[-3000:]
    )
    # Whichever process is rank 0 now publishes the job's progress, at the new size.
    client = EtcdClient(parse_endpoints(etcd.endpoint, 2379))
    try:
        progress = wait_for(
            "progress at world size 2",
            lambda: (
                p
                if (p := read_progress(client, run_id)) and p.world_size == 2 and p.step > int(at)
                else None
            ),
            30,
            second_log,
        )
        assert progress.step > int(at)
    finally:
        client.close()

    family = descendants(first.pid)
    os.killpg(first.pid, signal.SIGTERM)
    wait_for("the first agent to exit", lambda: first.poll(), 90, first_log)
    assert not still_running(family), still_running(family)


def test_a_frozen_peer_does_not_hold_the_survivor_in_a_gloo_collective(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"freeze-{uuid.uuid4().hex[:8]}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    args = train_args(tmp_path / "ckpt", 1_000_000, "--sleep=0.02")
    env = {"CRASH_AT_STEP": "-1", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off"}
    procs = [
        start(agents, etcd, log, args, nnodes="1:2", nproc=1, run_id=run_id, env=env)
        for log in logs
    ]
    wait_for(
        "training at world size 2",
        lambda: (
            True if "world=2" in logs[0].read_text() and "step=20 " in logs[0].read_text() else None
        ),
        180,
        logs[0],
    )
    frozen = [procs[1].pid, *descendants(procs[1].pid)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        # No TCP reset ever comes from a stopped process: without an abort the survivor
        # would sit in gloo's collective for its 30 min timeout.
        wait_for(
            "the survivor to go on alone",
            lambda: (
                True
                if re.search(r"^regrouped at step \d+ .*world=1 ", logs[0].read_text(), re.M)
                else None
            ),
            60,
            logs[0],
        )
        text = logs[0].read_text()
        assert len(steps_by_pid(text)) == 1, text[-3000:]
        wait_for(
            "a step at world size 1",
            lambda: True if re.search(r"^step=\d+ .*world=1 ", logs[0].read_text(), re.M) else None,
            60,
            logs[0],
        )
    finally:
        for pid in frozen:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)


@pytest.mark.parametrize("linger_at", ["finish", "finished"])
def test_a_node_that_joins_as_training_ends_gets_the_final_state_and_every_agent_exits_0(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path, linger_at: str
) -> None:
    """The newcomer's round must be one the finishing worker builds: before, a worker
    whose loop had ended never read the round its agent joined for it, and the newcomer
    waited in that round for the group's 30-minute timeout (the first agent 300 s in its
    exit barrier). ``finish``: the worker holds still before ``Run.finish()``, so its
    agent regroups it in place, and it builds the round on its way out. ``finished``: it
    holds still after it said it finished, so its agent restarts it into the round
    instead, from the final checkpoint."""
    run_id = f"late-{uuid.uuid4().hex[:8]}"
    steps = 30
    linger = tmp_path / "linger"
    linger.mkdir()
    args = [str(LINGER_AT_END), *train_args(tmp_path / "ckpt", steps, "--sleep=0.05")[1:]]
    env = {
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off",
        "LINGER_AT": linger_at,
        "LINGER_DIR": str(linger),
    }
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = start(agents, etcd, logs[0], args, nnodes="1:2", nproc=1, run_id=run_id, env=env)
    wait_for("the end of training", lambda: any(linger.glob("lingering-*")) or None, 240, logs[0])
    second = start(agents, etcd, logs[1], args, nnodes="1:2", nproc=1, run_id=run_id, env=env)
    agent_says = (
        "regrouping the running workers in place"
        if linger_at == "finish"
        else "a worker has finished training; restarting the workers"
    )
    wait_for(
        "the first agent to take the newcomer",
        lambda: agent_says in logs[0].read_text() or None,
        240,
        logs[1],
    )
    (linger / "go").write_text("")
    for proc, log in zip((first, second), logs, strict=True):
        wait_for("the agent to exit", lambda p=proc: p.poll() is not None or None, 180, log)
        assert proc.returncode == 0, log.read_text()[-4000:]
    text = logs[0].read_text() + logs[1].read_text()
    newcomer = logs[1].read_text()
    assert re.search(rf"^resumed from step {steps} ", newcomer, re.M), newcomer[-3000:]
    results = [json.loads(r) for r in re.findall(r"^ELASTICJOB_RESULT (.*)$", text, re.M)]
    # The last round's rank 0 reports training at both nodes (a worker the agent stopped
    # after it finished may have reported its own end too).
    assert {r["steps"] for r in results} == {steps}, text[-4000:]
    assert (steps, 2) in {(r["steps"], r["world_size"]) for r in results}, text[-4000:]


def test_after_rank_0_dies_the_new_rank_0_goes_on_writing_the_checkpoint_directory(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    """The survivor that becomes rank 0 in place takes over the directory's writes: the
    writer was fixed at the process's start, so after the first rank 0 died nobody
    wrote there again, and a full restart later went back to its last save."""
    procs, logs = two_nodes(agents, etcd, tmp_path, "1:2")
    ckpt = tmp_path / "ckpt"
    rank_0 = next(
        i for i, log in enumerate(logs) if re.search(r"^step=\d+ .*rank=0 ", log.read_text(), re.M)
    )
    family = descendants(procs[rank_0].pid)
    os.killpg(procs[rank_0].pid, signal.SIGKILL)  # the agent and its worker, at once
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    survivor = logs[1 - rank_0]
    killed_at = max(int(s) for s in re.findall(r"^step=(\d+) ", survivor.read_text(), re.M))
    wait_for(
        "the survivor 40 steps on, alone, as rank 0",
        lambda: (
            True
            if any(
                int(s) >= killed_at + 40
                for s in re.findall(r"^step=(\d+) .*world=1 rank=0 ", survivor.read_text(), re.M)
            )
            else None
        ),
        180,
        survivor,
    )
    saved = sorted(
        int(m.group(1)) for p in ckpt.glob("step-*.pt") if (m := STEP_FILE.match(p.name))
    )
    assert saved and saved[-1] > killed_at + 10, (
        f"newest checkpoint step {saved[-1] if saved else None} in {ckpt}; rank 0 died at "
        f"about step {killed_at}"
    )
    os.killpg(procs[1 - rank_0].pid, signal.SIGTERM)
    wait_for("the survivor's agent to exit", lambda: procs[1 - rank_0].poll(), 90, survivor)


STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
