"""A round that can never form does not hold its workers: real launcher, real etcd,
torch over gloo.

The hang CI met: node a's agent froze (its lease lapsed), node b opened the next round
and waited for a to come back; before it did, b's worker died. When a returned, the two
agents sealed that round and a's worker regrouped into it, connecting to the store that
b's dead worker would have served. b's agent meanwhile restarted its worker into a newer
round. TCPStore's client retries its connect for the group timeout (30 min), so a's
worker never took the newer round. Here the same order is made by hand: stop a's agent,
wait for b to open the round, kill b's worker, continue a. Training has to go on at
world size 2 with a's worker regrouped in place (no restart), and finish.
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
from conftest import EtcdServer, still_running, wait_for
from two_nodes import start_two_nodes, steps_of, workers_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 80


def test_a_worker_regrouping_into_a_round_whose_rank_0_died_takes_the_newer_round(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"superseded-{uuid.uuid4().hex[:8]}"
    procs, logs = start_two_nodes(
        agents,
        etcd,
        tmp_path,
        run_id,
        ["-m", "elasticjob_examples.train_regression"],
        steps=STEPS,
        sleep=0.05,
        max_restarts=1,
    )

    def pid_past(node: str, step: int) -> int | None:
        done = [pid for s, _, pid in steps_of(workers_of(tmp_path, node)) if s >= step]
        return done[-1] if done else None

    def state() -> str:
        sides = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        workers = "\n".join(f"--- {n}'s workers\n{workers_of(tmp_path, n)[-1500:]}" for n in "ab")
        return f"{sides}\n{workers}"

    a_worker = wait_for("a's worker to train", lambda: pid_past("a", 10), 180, logs[0])
    b_worker = wait_for("b's worker to train", lambda: pid_past("b", 10), 60, logs[1])
    os.kill(procs[0].pid, signal.SIGSTOP)  # the agent only: its worker trains on
    try:
        wait_for(
            "b to see a's lease lapse and open the next round",
            lambda: (
                True if re.search(r"restarts its workers: lost peer", logs[1].read_text()) else None
            ),
            30,
            logs[1],
        )
        os.kill(b_worker, signal.SIGKILL)  # rank 0 of the round b waits in, never served
        time.sleep(0.5)
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
    try:
        for proc in procs:
            # generous: the fix costs a store-connect window; the hang was 30 min
            wait_for("the job to finish", lambda p=proc: p.poll(), 240, logs[0])
    except BaseException:
        print(state())
        raise
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, f"{log.name}\n{state()}"
    a_steps = steps_of(workers_of(tmp_path, "a"))
    assert max(step for step, _, _ in a_steps) == STEPS, state()
    assert {pid for _, _, pid in a_steps} == {a_worker}, "a's worker restarted, not regrouped"
    assert {world for _, world, _ in a_steps} == {2}, state()
    assert not still_running([b_worker])
