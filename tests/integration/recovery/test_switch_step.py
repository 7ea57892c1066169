"""Every rank of a round leaves it at the same step boundary, whenever its agent hears of
the next round: real agents, real etcd, real torch workers over gloo.

One of the two first nodes runs ``workers/slow_delivery_launcher.py``: its agent hands
every later round to its worker seconds after the other agent does, so the two workers
hear of a join, or of a third node's departure, many steps apart. Before the ranks
voted (training/switch_vote.py), the worker that heard first left the old group at its
next boundary, and the late one's step in flight failed and was dropped. Now both switch
at the same boundary: no step is dropped, and both regroup at the last step the old
round trained together.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, start, wait_for
from test_in_place import steps_by_pid, train_args

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOW = [sys.executable, str(WORKERS / "slow_delivery_launcher.py")]
DELAY_S = 2.0  # about 30 steps of --sleep=0.05: the other worker hears that much earlier


def at_world(world: int, log: Path) -> int | None:
    """The newest step ``log``'s worker trained at ``world`` (None: none yet)."""
    found = re.findall(rf"^step=(\d+) .*world={world} ", log.read_text(), re.M)
    return max(int(s) for s in found) if found else None


def start_nodes(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path, count: int
) -> tuple[str, list[subprocess.Popen[bytes]], list[Path]]:
    """``count`` nodes of one worker each, the first of them slow to deliver, training
    at world ``count``; returns the run id, the agents and their logs."""
    run_id = f"switch-{uuid.uuid4().hex[:8]}"
    logs = [tmp / f"node{i}.log" for i in range(count)]
    procs = [start_node(agents, etcd, tmp, run_id, log, slow=i == 0) for i, log in enumerate(logs)]
    wait_for(
        f"training at world size {count}",
        lambda: True if (at_world(count, logs[0]) or 0) >= 20 else None,
        240,
        logs[0],
    )
    return run_id, procs, logs


def start_node(
    agents: list[subprocess.Popen[bytes]],
    etcd: EtcdServer,
    tmp: Path,
    run_id: str,
    log: Path,
    slow: bool,
) -> subprocess.Popen[bytes]:
    args = train_args(tmp / "ckpt", 1_000_000, "--sleep=0.05", "--epochs=1000")
    env = {
        "CRASH_AT_STEP": "-1",
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off",
        "ELASTICJOB_TEST_DELIVERY_DELAY": str(DELAY_S),
    }
    launcher = SLOW if slow else None
    return start(
        agents, etcd, log, args, nnodes="1:3", nproc=1, run_id=run_id, env=env, launcher=launcher
    )


def wait_for_steps_at(
    world: int, old_world: int, log: Path, fail_log: Path, timeout: float
) -> None:
    """Until ``log``'s worker trained 5 steps at ``world`` past its last at ``old_world``."""
    wait_for(
        f"5 steps at world size {world}",
        lambda: (
            True if (at_world(world, log) or 0) >= (at_world(old_world, log) or 0) + 5 else None
        ),
        timeout,
        fail_log,
    )


def assert_switched_together(logs: list[Path], old_world: int) -> None:
    """Both first nodes' workers regrouped once, at the last step the old round trained
    (on every node), kept their process, and dropped and abandoned nothing."""
    last_together = max(at_world(old_world, log) or 0 for log in logs)
    for log in logs[:2]:
        text = log.read_text()
        assert not re.search(r"step \d+ dropped", text), text[-3000:]
        assert "abandoning the round's collectives" not in text, text[-3000:]
        assert len(steps_by_pid(text)) == 1, text[-3000:]
        regrouped = re.findall(r"^regrouped at step (\d+) ", text, re.M)
        assert [int(s) for s in regrouped] == [last_together], (regrouped, last_together)
    assert "test: delivering round" in logs[0].read_text()  # the straddle did happen


def test_a_join_heard_late_by_one_rank_switches_every_rank_at_one_step(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id, _, logs = start_nodes(agents, etcd, tmp_path, 2)
    logs.append(tmp_path / "joiner.log")
    start_node(agents, etcd, tmp_path, run_id, logs[2], slow=False)
    wait_for_steps_at(3, 2, logs[0], logs[2], 240)
    assert_switched_together(logs, old_world=2)
    (at,) = re.findall(r"^regrouped at step (\d+) ", logs[0].read_text(), re.M)
    joiner = logs[2].read_text()
    assert re.search(rf"^resumed from step {at} \(rank \d at step {at}\)", joiner, re.M), joiner


def test_a_departure_heard_late_by_one_survivor_switches_both_at_one_step(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    _, procs, logs = start_nodes(agents, etcd, tmp_path, 3)
    procs[2].send_signal(signal.SIGTERM)  # the agent alone, as the kubelet signals a pod
    wait_for("the leaving agent to exit", lambda: procs[2].poll(), 90, logs[2])
    assert procs[2].returncode == 143, logs[2].read_text()[-3000:]
    assert "this node left the job and its peers went on without it" in logs[2].read_text()
    wait_for_steps_at(2, 3, logs[0], logs[0], 90)
    assert_switched_together(logs, old_world=3)
