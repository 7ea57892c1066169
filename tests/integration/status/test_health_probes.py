"""The agent's probes under a real elasticjob-run: live while it answers, ready in a round.

Two agents of a two-node job on a real etcd, each with its own ELASTICJOB_HEALTH_PORT (as
the kubelet probes each pod's). Every agent runs in its own session and is killed with its
tree at the end (conftest's ``agents``); the test also checks that nothing it started
outlives the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, free_port, start, still_running, wait_for

from elasticjob_devcluster.procs import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAIN = WORKERS / "rdzv_train.py"
TIMED_OUT = -1


def probe(port: int, path: str, timeout: float = 2.0) -> int:
    """The status code, or TIMED_OUT when the agent does not answer within ``timeout``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except (TimeoutError, urllib.error.URLError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):
            return TIMED_OUT
        raise


def answers(port: int, path: str, code: int) -> bool | None:
    """For ``wait_for``: True once ``path`` answers ``code`` (a refused connection: not yet)."""
    try:
        return True if probe(port, path) == code else None
    except urllib.error.URLError:
        return None


def lost_peer(log: Path, offset: int) -> bool | None:
    """For ``wait_for``: True once the agent logged, after ``offset``, that a peer left."""
    with log.open("rb") as f:
        f.seek(offset)
        return True if b"the round lost" in f.read() else None


def test_probes_follow_the_agent_live_while_it_answers_ready_once_it_joined(
    etcd: EtcdServer, tmp_path: Path, agents: list[subprocess.Popen[bytes]]
) -> None:
    run_id = f"health-{uuid.uuid4().hex[:8]}"
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]

    def launch(i: int) -> subprocess.Popen[bytes]:
        env = {
            "ELASTICJOB_HEALTH_PORT": str(ports[i]),
            "RDZV_TEST_OUT": str(tmp_path),
            "RDZV_TEST_STEPS": "100000",
            "RDZV_TEST_PAUSE": "0.1",
        }
        return start(
            agents,
            etcd,
            logs[i],
            [str(TRAIN)],
            nproc=1,
            max_restarts=3,
            env=env,
            nnodes="2",
            run_id=run_id,
        )

    def within(what: str, check: Callable[[], object | None], bound: float, i: int = 0) -> None:
        wait_for(what, check, bound, logs[i])

    first = launch(0)
    # Live as soon as it serves (before its spares are warm); not ready: a two-node job
    # with one node waits in the rendezvous.
    within("agent 0 to answer /healthz", lambda: answers(ports[0], "/healthz", 200), 60)
    for _ in range(5):
        assert probe(ports[0], "/readyz") == 503

    second = launch(1)
    steps = tmp_path / "steps.jsonl"
    within("training to run", lambda: True if steps.exists() else None, 180)
    for i in (0, 1):
        within(f"agent {i} to be ready", lambda i=i: answers(ports[i], "/readyz", 200), 60, i)

    # A frozen agent does not answer, so the kubelet's liveness probe fails and restarts it.
    # Its peer loses it (the lease) and waits in the rendezvous for a second node, and
    # stays ready meanwhile: it has joined the job, and a pod that went not ready at every
    # rendezvous would hide its node's loss from the operator (agent.py says why).
    workers = descendants(first.pid) + descendants(second.pid)
    lost = logs[1].stat().st_size
    os.kill(first.pid, signal.SIGSTOP)
    try:
        assert probe(ports[0], "/healthz", timeout=2.0) == TIMED_OUT
        assert probe(ports[0], "/readyz", timeout=2.0) == TIMED_OUT
        within("agent 1 to see its peer go", lambda: lost_peer(logs[1], lost), 60, 1)
        assert probe(ports[1], "/healthz") == 200
        assert probe(ports[1], "/readyz") == 200
    finally:
        os.kill(first.pid, signal.SIGCONT)
    within("agent 0 to answer again", lambda: answers(ports[0], "/healthz", 200), 30)
    assert probe(ports[0], "/readyz") == 200

    (tmp_path / "stop").touch()
    for i, proc in enumerate((first, second)):
        within(f"agent {i} to finish", proc.poll, 180, i)
        assert proc.returncode == 0, logs[i].read_text(errors="replace")[-3000:]
    # everything the agents started (workers, warm spares) is gone with them
    within(
        "the workers and spares to exit", lambda: True if not still_running(workers) else None, 60
    )
    with pytest.raises(urllib.error.URLError):
        probe(ports[0], "/healthz")  # the server went with its agent
