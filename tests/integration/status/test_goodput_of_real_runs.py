"""The goodput ledger of real runs (real etcd, real agents, torch workers over gloo),
checked against the workers' own step lines: an independent clock.

A worker SIGKILLs itself after step 25. In place, the survivors keep their ledger and
book one recovery, a crash (the round its agent opened says so); on the restart path
the whole group starts again from the step-20 checkpoint, and its new rank 0 takes on
the ledger the old one published. Either way
every second falls in one bucket, and the recovery's pause is the gap in the step lines
less one step.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import WORKERS, EtcdServer, start, wait_for

from elasticjob_runtime import contract
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.progress import published_ledger
from elasticjob_runtime.goodput import ledger as gl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 50
CRASH_AT = 25


def run_with_a_crash(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path, in_place: bool
) -> tuple[str, gl.Ledger]:
    """Two agents of one worker each; global rank 1 SIGKILLs itself after step 25.
    Returns rank 0's step lines and the ledger the run left in etcd."""
    run_id = f"ledger-{uuid.uuid4().hex[:8]}"
    env = {
        "CRASH_AT_STEP": str(CRASH_AT),
        "ELASTICJOB_IN_PLACE": "1" if in_place else "0",
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": "off",
    }
    args = [
        str(WORKERS / "crash_once.py"),
        f"--steps={STEPS}",
        "--samples=1024",
        "--batch-size=8",
        "--checkpoint-interval=10",
        "--log-every=1",
        "--sleep=0.05",
        f"--checkpoint-dir={tmp / 'ckpt'}",
    ]
    procs, logs = [], [tmp / "a.log", tmp / "b.log"]
    for log in logs:
        procs.append(
            start(
                agents, etcd, log, args, nnodes="2", nproc=1, max_restarts=1, run_id=run_id, env=env
            )
        )
    for proc, log in zip(procs, logs, strict=True):
        wait_for("the job to finish", lambda p=proc: p.poll(), 300, log)
        assert proc.returncode == 0, log.read_text()[-4000:]
    client = EtcdClient(parse_endpoints(etcd.endpoint))
    try:
        assert client.get(contract.progress_key(run_id)) is None  # withdrawn at the end
        doc = published_ledger(client, run_id)  # the ledger key outlives it
        kept = client.get(contract.ledger_key(run_id))
        assert kept is not None and kept.lease  # on a lease of its own (LEDGER_TTL_S)
    finally:
        client.close()
    assert doc is not None, "no ledger in etcd"
    return "\n".join(log.read_text() for log in logs), gl.decode(doc)


def step_times(text: str) -> list[tuple[int, float, int]]:
    """(step, unix time, pid) of each step line, in the order logged."""
    return [
        (int(step), float(t), int(pid))
        for step, pid, t in re.findall(r"^step=(\d+) .* pid=(\d+) t=([\d.]+)", text, re.M)
    ]


def typical_gap(lines: list[tuple[int, float, int]]) -> float:
    """The median time between the lines of consecutive steps."""
    ordered = sorted(lines, key=lambda line: line[1])
    return statistics.median(
        b[1] - a[1] for a, b in itertools.pairwise(ordered) if b[0] == a[0] + 1
    )


def gap_less_a_step(lines: list[tuple[int, float, int]], before: int, after: int) -> float:
    """From the line of step ``before`` to the first line of step ``after`` that comes
    after it, less a typical step."""
    ordered = sorted(lines, key=lambda line: line[1])
    t0 = next(t for step, t, _ in ordered if step == before)
    t1 = next(t for step, t, _ in ordered if step == after and t > t0)
    return t1 - t0 - typical_gap(lines)


def assert_every_second_booked(ledger: gl.Ledger) -> None:
    assert ledger.accounted == pytest.approx(ledger.wall, rel=0.01)
    assert ledger.training > 0 and ledger.startup > 0
    assert ledger.recovering is None
    assert ledger.step == STEPS
    assert 0 < (ledger.goodput or 0) < 1


def assert_pause_agrees(booked: float, measured: float, slack: float = 0.2) -> None:
    assert abs(booked - measured) <= max(slack, 0.1 * measured), (booked, measured)


def test_a_crash_in_place_is_one_recovery_whose_pause_the_step_lines_confirm(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    text, ledger = run_with_a_crash(agents, etcd, tmp_path, in_place=True)
    assert_every_second_booked(ledger)
    # the killed worker's agent opened the next round, saying why: the survivor, which saw
    # only a broken collective, books a crash
    assert ledger.recoveries == {"crash": 1}, json.dumps(gl.encode(ledger))
    assert set(ledger.paused) == {"crash"}
    lines = step_times(text)
    assert_pause_agrees(ledger.longest_pause, gap_less_a_step(lines, CRASH_AT, CRASH_AT + 1))
    assert ledger.lost < 1.0  # at most the step in flight


def test_a_restart_from_a_checkpoint_books_its_pause_and_the_steps_done_again_as_lost(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    text, ledger = run_with_a_crash(agents, etcd, tmp_path, in_place=False)
    assert_every_second_booked(ledger)
    assert ledger.recoveries == {"restart": 1}, json.dumps(gl.encode(ledger))
    lines = step_times(text)
    # the new group resumed from a checkpoint (step 20's, or step 25's if a SIGTERM saved
    # it): its first line is the step after that one
    resumed = max(int(n) for n in re.findall(r"^resumed from step (\d+) \(", text, re.M))
    # Rank 0 of the killed group publishes its newest ledger on its way out, unless it
    # ended by os._exit (a SIGTERM save in a broken group): then the new group takes one
    # up to a second old, and the pause is that much longer (docs/goodput.md).
    gap = gap_less_a_step(lines, CRASH_AT, resumed + 1)
    assert_pause_agrees(ledger.longest_pause, gap, slack=1.2)
    step_time = typical_gap(lines)
    redone = CRASH_AT - resumed  # done twice: the second time is lost work
    assert ledger.lost == pytest.approx(redone * step_time, abs=1.5 * step_time)
