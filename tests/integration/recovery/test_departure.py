"""A node told to stop (SIGTERM: a pod deleted, a drain, a preemption) under the real
launcher, real etcd and real torch workers over gloo.

While a round trains, the node announces its departure: its peer regroups without it at
a step boundary, keeping its process and memory, and drops no step; the leaving worker
leaves at that same boundary, and its agent exits 143. At any other moment, or
when every node is stopped at once, a SIGTERM stops the agent as torchrun's would: the
workers save their last step, and it still exits 143, never 0 or 1.
"""

from __future__ import annotations

import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import EtcdServer, start, still_running, wait_for
from test_in_place import STEP_FILE, steps_by_pid, train_args, two_nodes

from elasticjob_devcluster.procs import descendants
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.rendezvous.keys import members_prefix

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_node_that_leaves_hands_over_and_its_peer_drops_no_step(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    procs, logs = two_nodes(agents, etcd, tmp_path, "1:2")
    leaver, stayer = procs[1], procs[0]
    family = descendants(leaver.pid)
    leaver.send_signal(signal.SIGTERM)  # the agent alone, as the kubelet signals a pod
    wait_for("the leaving agent to exit", lambda: leaver.poll(), 60, logs[1])
    assert leaver.returncode == 143, logs[1].read_text()[-3000:]
    assert not still_running(family), still_running(family)
    left = logs[1].read_text()
    assert "announced this node's departure" in left, left[-3000:]
    assert "departure: the workers have left; exiting" in left, left[-3000:]
    assert "this node left the job and its peers went on without it" in left, left[-3000:]

    wait_for(
        "the peer training alone",
        lambda: True if re.search(r"^step=\d+ .*world=1 ", logs[0].read_text(), re.M) else None,
        60,
        logs[0],
    )
    text = logs[0].read_text()
    # One process all along, switched at a step boundary: nothing abandoned, no step dropped.
    assert len(steps_by_pid(text)) == 1, text[-3000:]
    assert "announced its departure" in text, text[-3000:]
    assert "abandon its collectives" not in text, text[-3000:]
    assert not re.search(r"step \d+ dropped", text), text[-3000:]
    (at,) = re.findall(r"^regrouped at step (\d+) ", text, re.M)
    last_together = max(int(s) for s in re.findall(r"^step=(\d+) .*world=2 ", left, re.M))
    assert int(at) == last_together, (at, last_together)
    stayer.send_signal(signal.SIGTERM)
    wait_for("the last agent to exit", lambda: stayer.poll(), 90, logs[0])
    assert stayer.returncode == 143, logs[0].read_text()[-3000:]


def test_stopping_every_node_at_once_saves_the_last_step_and_each_exits_143(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    procs, logs = two_nodes(agents, etcd, tmp_path, "2")
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc, log in zip(procs, logs, strict=True):
        wait_for("the agent to exit", lambda p=proc: p.poll(), 90, log)
        assert proc.returncode == 143, log.read_text()[-3000:]
    last = max(int(s) for s in re.findall(r"^step=(\d+) ", logs[0].read_text(), re.M))
    saved = sorted(
        int(m.group(1))
        for p in (tmp_path / "ckpt").glob("step-*.pt")
        if (m := STEP_FILE.match(p.name))
    )
    assert saved and saved[-1] >= last, (saved, last)


def test_a_sigterm_before_any_round_exits_143_and_drops_the_member_key_at_once(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"lonely-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "agent.log"
    args = train_args(tmp_path / "ckpt", 10, "--sleep=0.05")
    env = {"CRASH_AT_STEP": "-1", "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off"}
    proc = start(agents, etcd, log, args, nnodes="2", nproc=1, run_id=run_id, env=env)
    client = EtcdClient(parse_endpoints(etcd.endpoint, 2379))
    try:
        members = members_prefix(run_id)
        wait_for("the agent to register", lambda: client.snapshot(members).items or None, 120, log)
        proc.send_signal(signal.SIGTERM)
        wait_for("the agent to exit", lambda: proc.poll(), 60, log)
        assert proc.returncode == 143, log.read_text()[-3000:]
        assert not client.snapshot(members).items  # revoked, not left to its TTL
    finally:
        client.close()
