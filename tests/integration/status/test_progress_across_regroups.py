"""What the operator reads of a job's progress never goes back when rank 0 changes hands.

``make demo`` showed ``step=0 samples/s=0`` for a poll after a regroup: the new global
rank 0 made a reporter that published a placeholder record before its first step. Here
a node joins a running job (two real agents, the example under the training-loop API,
real etcd) and every record the job's etcd held while it trained is read back.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import EtcdServer, read_progress, start, wait_for

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.records import Progress

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def records_until(client: EtcdClient, run: str, stop: threading.Event) -> list[Progress]:
    """Every distinct record under the run's progress key, polled every 20 ms."""
    seen: list[Progress] = []
    while not stop.is_set():
        record = read_progress(client, run)
        if record is not None and (not seen or record != seen[-1]):
            seen.append(record)
        time.sleep(0.02)
    return seen


def test_a_node_joining_never_sends_the_published_step_back_or_the_rate_to_zero(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run = f"progress-{uuid.uuid4().hex[:8]}"
    train = [
        "-m",
        "elasticjob_examples.train_regression",
        "--steps=500",
        "--sleep=0.03",
        f"--checkpoint-dir={tmp_path / 'ckpt'}",
    ]
    client = EtcdClient(parse_endpoints(etcd.endpoint))
    stop = threading.Event()
    found: list[Progress] = []
    watcher = threading.Thread(target=lambda: found.extend(records_until(client, run, stop)))
    watcher.start()
    try:
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        first = start(agents, etcd, first_log, train, nproc=1, nnodes="1:2", run_id=run)
        wait_for("training", lambda: "step=60 " in first_log.read_text() or None, 180, first_log)
        second = start(agents, etcd, second_log, train, nproc=1, nnodes="1:2", run_id=run)
        for proc, log in ((first, first_log), (second, second_log)):
            assert wait_for("the job to end", lambda p=proc: p.poll(), 240, log) == 0
    finally:
        stop.set()
        watcher.join()
        client.close()

    # Ranks follow the order the nodes entered the round. The newcomer opens it and
    # usually enters first, becoming rank 0 and the publisher; on a loaded machine the
    # first node's agent can enter before it (two requests race). Either way exactly one
    # of them published at world 2, and the records below must hold across the join.
    publishers = [log for log in (first_log, second_log) if "world=2 rank=0" in log.read_text()]
    assert len(publishers) == 1, [log.read_text()[-2000:] for log in (first_log, second_log)]
    worlds = [r.world_size for r in found]
    assert worlds[0] == 1 and worlds[-1] == 2, worlds
    steps = [r.step for r in found]
    assert steps == sorted(steps) and steps[0] > 0, steps
    assert all(r.samples_per_second > 0 for r in found), [
        (r.step, r.samples_per_second) for r in found
    ]
