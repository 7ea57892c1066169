"""A hung worker group is restarted by its agents: real launcher, real etcd, torch over gloo.

One training process of two (one per agent) is frozen with SIGSTOP, its agent left
alone. Its peer blocks in the step's collective, so neither completes a step; after the
hang timeout the agents restart the group (waking the stopped one so it saves and
exits), record the hang once for the operator, and training goes on to the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, start, still_running, wait_for
from two_nodes import start_two_nodes, steps_of
from two_nodes import workers_of as workers_of_node

from bench.harness import wait_for as poll
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.records import decode_hang

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_TIMEOUT_S = 5
STEPS = 400
FREEZE_AFTER = 30


def test_a_frozen_training_process_restarts_the_group_and_training_goes_on(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"hang-{uuid.uuid4().hex[:8]}"
    procs, logs = start_two_nodes(
        agents,
        etcd,
        tmp_path,
        run_id,
        ["-m", "elasticjob_examples.train_regression"],
        steps=STEPS,
        sleep=0.02,
        max_restarts=2,  # the hang costs each agent one
        flags={node: (f"--hang-timeout={HANG_TIMEOUT_S}",) for node in "ab"},
    )

    def workers_of(node: str) -> str:
        return workers_of_node(tmp_path, node)

    def a_worker_past_the_freeze_step() -> int | None:
        done = [pid for step, _, pid in steps_of(workers_of("b")) if step >= FREEZE_AFTER]
        return done[-1] if done else None

    frozen = wait_for(
        "node b's worker to pass step 30", a_worker_past_the_freeze_step, 180, logs[1]
    )
    os.kill(frozen, signal.SIGSTOP)  # the training process, not its agent
    frozen_at = max(step for step, _, pid in steps_of(workers_of("b")) if pid == frozen)

    try:
        for proc in procs:
            poll("the job to finish", lambda p=proc: p.poll(), 300)
    except TimeoutError as exc:  # both agents' and node b's workers' side: a stall has two
        sides = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"{exc}\n{sides}\n--- node b's workers\n{workers_of('b')[-3000:]}")
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, (  # the workers' side too: where each resumed from
            f"{log.read_text()[-4000:]}\n--- node a's workers\n{workers_of('a')[-3000:]}"
            f"\n--- node b's workers\n{workers_of('b')[-3000:]}"
        )
    agent_logs = "\n".join(log.read_text() for log in logs)
    assert re.search(r"hang 1: no training step for \d+ s \(hang timeout 5 s\)", agent_logs), (
        agent_logs[-4000:]
    )
    assert not still_running([frozen]), "the frozen worker was left behind"

    # Training went on past the freeze, in new processes, to the last step.
    after = [(s, p) for s, _, p in steps_of(workers_of("b")) if p != frozen]
    assert any(pid != frozen and step > frozen_at for step, pid in after)
    assert max(step for step, _, _ in steps_of(workers_of("a") + "\n" + workers_of("b"))) == STEPS

    # Recorded once for the operator, however many agents noticed.
    client = EtcdClient(parse_endpoints(etcd.endpoint))
    try:
        items = client.snapshot(contract.hang_prefix(run_id)).items
    finally:
        client.close()
    hangs = [decode_hang(kv.value) for kv in items.values()]
    assert len(hangs) == 1, hangs
    assert hangs[0].timeout_seconds == HANG_TIMEOUT_S
    assert hangs[0].step in (frozen_at, frozen_at + 1)  # its peer may log the next one
    assert hangs[0].stalled_seconds >= HANG_TIMEOUT_S


def test_a_hang_costs_a_restart_and_with_none_left_the_agent_fails(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    proc = start(
        agents,
        etcd,
        log,
        [str(WORKERS / "hang_after.py")],
        nproc=1,
        max_restarts=1,
        launcher_flags=("--hang-timeout=3",),
        env={"HANG_AFTER": "5", "CKPT_DIR": str(tmp_path / "ckpt")},
    )
    wait_for("the agent to give up", proc.poll, 180, log)
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    # the first hang restarted the group (its one restart), the second ended it
    assert re.findall(r"^step=5 attempt=(\d)$", text, re.M) == ["0", "1"], text[-3000:]
    assert len(re.findall(r"hang \d: no training step for \d+ s", text)) == 2, text[-3000:]
    assert "workers failed and no restarts are left" in text
