"""A frozen worker does not hold a regroup for ever: real launcher, real etcd, torch over gloo.

Two agents, one training process each (the training-loop API, so a healthy worker
regroups in place). One process stops making progress with its agent left alone. The
other agent declares the hang first (its hang timeout is the shorter one, so the order
that lost on kind is the order here every time), restarts its own worker and opens the
next round. The frozen worker's agent must not hand that round to its frozen worker in
place and wait for it: its offer to regroup in place outlived it. Training has to resume
at world size 2 and finish, every agent exiting 0.

* SIGSTOP: the agent sees the process stopped and restarts it into the round.
* a deadlock (the training thread blocks for ever; the process runs): nothing tells it
  from a worker in a long step when the round opens, so it is handed the round in place;
  it never takes it, and its agent restarts it as a hang once the hang timeout passed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, still_running, wait_for
from two_nodes import start_two_nodes, steps_of, workers_of

from bench.harness import wait_for as poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 300
FREEZE_AFTER = 30
FIRST_TIMEOUT_S = 5  # node a: declares the hang and opens the next round
# node b (the frozen worker's): far longer, so its own clock never decides the order
STOPPED_TIMEOUT_S = 60
DEADLOCK_TIMEOUT_S = 14


def train(
    agents: list[subprocess.Popen[bytes]],
    etcd: EtcdServer,
    tmp_path: Path,
    script: list[str],
    timeouts: dict[str, int],
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """Nodes a and b, each with its hang timeout in ``timeouts``, nproc 1, one run."""
    return start_two_nodes(
        agents,
        etcd,
        tmp_path,
        f"frozen-{uuid.uuid4().hex[:8]}",
        script,
        steps=STEPS,
        sleep=0.02,
        max_restarts=2,  # a hang costs the agent that declares it one
        flags={node: (f"--hang-timeout={timeout}",) for node, timeout in timeouts.items()},
    )


def freeze_and_see_training_resume(
    procs: list[subprocess.Popen[bytes]],
    logs: list[Path],
    tmp_path: Path,
    sig: signal.Signals,
    resume_within: float,
) -> int:
    """Send ``sig`` to node b's worker once it passed step FREEZE_AFTER; then training
    must go on at world size 2 past the freeze within ``resume_within`` seconds and to
    the end, both agents exiting 0. Returns the frozen pid."""

    def past_the_freeze_step() -> int | None:
        done = [pid for step, _, pid in steps_of(workers_of(tmp_path, "b")) if step >= FREEZE_AFTER]
        return done[-1] if done else None

    frozen = wait_for("node b's worker to pass the freeze step", past_the_freeze_step, 180, logs[1])
    os.kill(frozen, sig)  # the training process, not its agent
    frozen_at_s = time.monotonic()
    time.sleep(1)  # a step in flight when the signal came may still be logged
    frozen_at = max(s for s, _, pid in steps_of(workers_of(tmp_path, "b")) if pid == frozen)

    def state() -> str:
        sides = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
        return f"{sides}\n--- node b's workers\n{workers_of(tmp_path, 'b')[-2000:]}"

    def resumed() -> int | None:
        # Its peer may complete the step the frozen worker was in, never the one after.
        both = workers_of(tmp_path, "a") + "\n" + workers_of(tmp_path, "b")
        later = [s for s, world, pid in steps_of(both) if world == 2 and s > frozen_at + 1]
        return later[0] if later else None

    try:
        poll("training to resume at world size 2", resumed, resume_within)
    except TimeoutError as exc:
        pytest.fail(f"{exc} ({time.monotonic() - frozen_at_s:.0f} s after the freeze)\n{state()}")
    try:
        for proc in procs:
            poll("the job to finish", lambda p=proc: p.poll(), 300)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{state()}")
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-4000:]
    assert not still_running([frozen]), "the frozen worker was left behind"
    final = steps_of(workers_of(tmp_path, "a") + "\n" + workers_of(tmp_path, "b"))
    assert max(step for step, _, _ in final) == STEPS
    return frozen


def test_a_stopped_worker_is_restarted_into_the_next_round_not_regrouped_in_place(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    script = ["-m", "elasticjob_examples.train_regression"]
    timeouts = {"a": FIRST_TIMEOUT_S, "b": STOPPED_TIMEOUT_S}
    procs, logs = train(agents, etcd, tmp_path, script, timeouts)
    # b's own clock would take 60 s: the round a opens must not wait for it
    freeze_and_see_training_resume(procs, logs, tmp_path, signal.SIGSTOP, resume_within=45)
    a, b = (log.read_text() for log in logs)
    assert re.search(r"hang 1: no training step for \d+ s \(hang timeout 5 s\)", a), a[-4000:]
    assert "local rank 0 is stopped and cannot take a round" in b, b[-4000:]
    assert "regrouping the running workers in place" not in b, b[-4000:]


def test_a_deadlocked_worker_that_never_takes_its_round_is_restarted_as_a_hang(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    script = [str(WORKERS / "stall_on_signal.py")]
    timeouts = {"a": FIRST_TIMEOUT_S, "b": DEADLOCK_TIMEOUT_S}
    procs, logs = train(agents, etcd, tmp_path, script, timeouts)
    # a declares the hang at 5 s; b hands the round over in place (5 s of silence is not
    # half its 14 s), then restarts its worker 14 s later, when it has not taken it
    freeze_and_see_training_resume(procs, logs, tmp_path, signal.SIGUSR1, resume_within=120)
    b = logs[1].read_text()
    assert "regrouping the running workers in place" in b, b[-4000:]
    found = re.search(
        rf"hang 1: no training step for (\d+) s \(hang timeout {DEADLOCK_TIMEOUT_S} s\), "
        r"after step \d+, and local rank 0 never took its new round",
        b,
    )
    assert found, b[-4000:]
