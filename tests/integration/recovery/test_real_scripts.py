"""A realistic script (examples/train_gpt.py: AdamW, warmup + cosine LambdaLR, gradient
accumulation, bf16 autocast, GradScaler, clipping, dropout, EMA, a DataLoader with two
worker processes and a random augmentation) through real faults under the real
launcher, real etcd and real torch workers over gloo.

Correctness is proven by comparison: a faulted run and an unfaulted run with the same
seed and the same world history hold bitwise the same model, optimizer, scheduler,
scaler and EMA after every step, on every rank, and every sample is trained on once per
epoch. A script that forgets to register its scheduler stops, naming what differs.
"""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import EtcdServer, result_of
from gpt_jobs import (
    STEPS,
    assert_every_sample_once_per_epoch,
    assert_same_training,
    divergence_records,
    run_job,
    worlds,
)

from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints
from elasticjob_runtime.etcd.progress import published_ledger
from elasticjob_runtime.goodput import ledger as gl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_realistic_script_through_a_kill_and_a_join_trains_what_an_unfaulted_run_trains(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # World 2 until step 24, world 3 after it (a node joins while the group holds at 24);
    # in the faulted run rank 1 is SIGKILLed in step 13 besides, after its first
    # micro-batch: its peer holds that micro-batch's gradients when the step fails.
    join = {"HOLD_AT_STEP": "24", "HOLD_WORLD": "2"}
    faulted = run_job(
        agents,
        etcd,
        tmp_path / "faulted",
        {**join, "CRASH_IN_STEP": "13", "CRASH_RANK": "1"},
        2,
        "1:3",
        "held before step 24",
    )
    reference = run_job(agents, etcd, tmp_path / "reference", join, 2, "1:3", "held before step 24")

    # In place: one worker restarted, its peer kept its process and memory.
    assert re.search(r"^regrouped at step 12 \(own memory at step 12\)", faulted, re.M), faulted[
        -3000:
    ]
    assert re.search(r"^started \(rank \d at step 12\)", faulted, re.M), faulted[-3000:]
    assert {w for w in worlds(faulted).values()} == {2, 3}
    assert_same_training(faulted, reference)
    assert_every_sample_once_per_epoch(faulted)


def test_a_step_that_breaks_after_its_update_is_redone_from_a_checkpoint_not_twice(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # Every rank all-reduces right after its optimizer update; rank 1 dies at exactly that
    # point of step 13. The survivor's update of step 13 ran and the rest of its step did
    # not: dropping the step would apply the update twice, keeping it would leave the
    # scaler mid-step. It restarts instead, from the step-10 checkpoint, and steps 11-13
    # are redone. World 2 throughout in both runs.
    env = {"COLLECTIVE_AFTER_UPDATE": "1"}
    faulted = run_job(
        agents,
        etcd,
        tmp_path / "faulted",
        {**env, "CRASH_AFTER_UPDATE_IN_STEP": "13", "CRASH_RANK": "1"},
        2,
        "2",
    )
    reference = run_job(agents, etcd, tmp_path / "reference", env, 2, "2")
    assert "step 13 broke after the optimizer's update" in faulted, faulted[-3000:]
    assert re.search(r"^started \(checkpoint step 10\)", faulted, re.M), faulted[-3000:]
    assert_same_training(faulted, reference)
    assert_every_sample_once_per_epoch(faulted)


_PLANNED_SHRINK: list[str] = []  # the reference, run once for the tests that share it


def planned_shrink_at_15(agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path) -> str:
    """The reference for a node that goes after step 15: three nodes save step 15 and
    stop, two resume from that checkpoint. Returns both runs' logs. Two tests compare
    with it, and an unfaulted run is the same every time (their comparison proves it):
    the first test to ask runs it (five processes, about 12 s) and the other reuses it."""
    if not _PLANNED_SHRINK:
        first = run_job(agents, etcd, tmp, {"STOP_AT_STEP": "15"}, 3, "3")
        second = run_job(agents, etcd, tmp, {}, 2, "2")
        assert re.search(r"^started \(checkpoint step 15\)", second, re.M), second[-3000:]
        _PLANNED_SHRINK.append(first + second)
    return _PLANNED_SHRINK[0]


def test_a_realistic_script_that_loses_a_node_trains_what_a_planned_shrink_trains(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # Faulted: three nodes; after step 15 the node of rank 2 dies with its agent, and the
    # other two go on in place. Reference: three nodes save step 15 and stop; two
    # nodes resume from that checkpoint. Both: world 3 to step 15, world 2 after.
    faulted = run_job(
        agents,
        etcd,
        tmp_path / "faulted",
        {"LOSE_NODE_AT_STEP": "15", "LOSE_NODE_RANK": "2"},
        3,
        "2:3",
    )
    reference = planned_shrink_at_15(agents, etcd, tmp_path / "reference")

    assert len(re.findall(r"^regrouped at step 15 \(own memory at step 15\)", faulted, re.M)) == 2
    assert_same_training(faulted, reference)
    assert_every_sample_once_per_epoch(faulted)


def test_a_node_that_announces_its_departure_costs_no_step_and_trains_a_planned_shrink(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # Faulted: three nodes; after step 15 the agent of rank 2 gets SIGTERM (its pod is
    # deleted, its node drained). It announces its departure, the other two regroup
    # without it at the step boundary, and its worker leaves once their old group
    # breaks. Reference: the planned shrink of the lost-node test. Both: world 3 to step
    # 15, world 2 after.
    faulted = run_job(
        agents,
        etcd,
        tmp_path / "faulted",
        {"LEAVE_AT_STEP": "15", "LEAVE_RANK": "2"},
        3,
        "2:3",
    )
    reference = planned_shrink_at_15(agents, etcd, tmp_path / "reference")

    assert "announced this node's departure" in faulted, faulted[-3000:]
    assert "this node left the job and its peers went on without it" in faulted, faulted[-3000:]
    assert "departure: the workers have left; exiting" in faulted, faulted[-3000:]
    # The survivors switched at the boundary, with nothing abandoned and no step dropped.
    assert len(re.findall(r"^regrouped at step 15 \(own memory at step 15\)", faulted, re.M)) == 2
    assert "abandon its collectives" not in faulted, faulted[-3000:]
    assert not re.search(r"step \d+ dropped", faulted), faulted[-3000:]
    assert_same_training(faulted, reference)
    assert_every_sample_once_per_epoch(faulted)


def test_a_script_that_forgets_its_scheduler_stops_naming_the_divergence(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # Without the scheduler in run.wrap(state=...), the restarted worker's schedule starts
    # over: its learning rate differs from its peer's from the first step after the kill.
    run_id = f"diverge-{uuid.uuid4().hex[:8]}"
    env = {
        "CRASH_AT_STEP": "12",
        "CRASH_RANK": "1",
        "UNREGISTERED": "scheduler",
        "PET_RDZV_ENDPOINT": etcd.endpoint,  # where rank 0 records it for the operator
    }
    logs = run_job(agents, etcd, tmp_path, env, 2, "2", expect_ok=False, run_id=run_id)
    assert "ELASTICJOB_RESULT" not in logs
    differs = r"'optim' differs \(ranks \[\d\] vs \[\d\]\)"
    assert re.search(rf"at step 13 \(the first step after the group formed\) {differs}", logs), (
        logs[-4000:]
    )
    assert "not restarting the workers: the ranks trained different models" in logs
    assert len(re.findall(r"^started ", logs, re.M)) == 3  # 2 at first, 1 after the kill, no more
    # The operator's input: one record, which its rule "Divergence" turns into a failed job.
    [record] = divergence_records(etcd, run_id)
    assert (record.step, record.action) == (13, "stop")
    assert "'optim' differs" in record.message


def test_with_resync_the_ranks_take_rank_0s_state_and_train_on_saying_so(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    run_id = f"resync-{uuid.uuid4().hex[:8]}"
    env = {
        "CRASH_AT_STEP": "12",
        "CRASH_RANK": "1",
        "UNREGISTERED": "scheduler",
        "ON_DIVERGENCE": "resync",
        "PET_RDZV_ENDPOINT": etcd.endpoint,
    }
    logs = run_job(agents, etcd, tmp_path, env, 2, "2", run_id=run_id)
    assert re.search(r"'optim' differs .*; copying rank 0's state to every rank", logs), logs[
        -3000:
    ]
    # after each resync the ranks agree again on the step's state (the script still steps
    # its own schedulers apart, so later checks find them apart again: each is said)
    resynced = {int(s) for s in re.findall(r"at step (\d+) \([^)]*\) 'optim' differs", logs)}
    assert 13 in resynced
    assert result_of(logs)["steps"] == STEPS
    records = divergence_records(etcd, run_id)
    assert {r.step for r in records} == resynced and {r.action for r in records} == {"resync"}
    # the goodput ledger books the kill as a crash (its round said so) and each resync
    # as a divergence, each its own recovery
    client = EtcdClient(parse_endpoints(etcd.endpoint))
    try:
        doc = published_ledger(client, run_id)
    finally:
        client.close()
    assert doc is not None, "no goodput ledger in etcd"
    ledger = gl.decode(doc)
    assert ledger.recoveries == {"crash": 1, "divergence": len(resynced)}, doc
