"""Sharded models elastic in place: FSDP2 (examples/train_gpt_fsdp.py) under the real
launcher, real etcd and real torch workers over gloo.

Proven by comparison, at every step, with fingerprints of the whole sharded model and
optimizer that do not depend on the world size:

* a join moves the shards from the survivors' memory to the new world, and trains what a
  DCP save at world 2 and a load at world 3 train (the in-memory reshard is bitwise the
  DCP reshard, and the run is bitwise the unfaulted run with the same world history);
* a killed worker takes its shard with it: with shard copies the survivor holds a copy
  of it and the group goes back to the copies' step from memory; without them every rank
  reads the newest DCP checkpoint in place; either way the run trains what the unfaulted
  run trains;
* a node that announces its departure leaves a copy of its shard with its buddy at its
  last step: no step is lost, and the run trains what a planned shrink through DCP trains;
* a whole job told to stop saves its last committed step, every rank its own shards, and
  resumed from it trains what the unfaulted run trains;
* FSDP2 at world 2 trains, within float tolerance, what one process trains on the same
  global batch (the gradients are averaged, never summed: pytorch#162338).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import EtcdServer
from gpt_jobs import (
    PLAIN_SGD,
    assert_every_sample_once_per_epoch,
    assert_same_training,
    assert_trains_like_one_process,
    run_job,
    worlds,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FSDP = {"GPT_SCRIPT": "train_gpt_fsdp"}
_UNFAULTED: list[str] = []


def unfaulted_at_2(agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp: Path) -> str:
    """Two nodes, no fault, every step at world 2: the reference of the killed worker and
    of the stopped job. Shard copies and checkpoints change no state, so one run serves
    both (their comparisons prove it); the first test to ask runs it, the other reuses it."""
    if not _UNFAULTED:
        _UNFAULTED.append(run_job(agents, etcd, tmp, FSDP, 2, "2", extra=("--copy-every=4",)))
    return _UNFAULTED[0]


def test_an_fsdp_join_moves_the_shards_in_memory_and_trains_what_a_dcp_reshard_trains(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # In place: world 2 to step 12, a third node joins while the group holds, and the
    # shards move from memory to world 3. Reference: world 2 saves step 12 (DCP) and
    # stops; three nodes resume from it, DCP resharding to world 3.
    join = {**FSDP, "HOLD_AT_STEP": "12", "HOLD_WORLD": "2"}
    joined = run_job(agents, etcd, tmp_path / "joined", join, 2, "1:3", "held before step 12")
    first = run_job(agents, etcd, tmp_path / "reference", {**FSDP, "STOP_AT_STEP": "12"}, 2, "2")
    second = run_job(agents, etcd, tmp_path / "reference", FSDP, 3, "3")

    assert len(re.findall(r"^regrouped at step 12 \(own memory at step 12\)", joined, re.M)) == 2
    assert re.search(r"^started \(rank \d at step 12\) .* world=3 ", joined, re.M), joined[-3000:]
    assert re.search(r"^started \(checkpoint step 12\) .* world=3 ", second, re.M), second[-3000:]
    assert {w for w in worlds(joined).values()} == {2, 3}
    assert_same_training(joined, first + second)
    assert_every_sample_once_per_epoch(joined)


def test_a_killed_fsdp_worker_goes_back_to_the_shard_copies_or_the_checkpoint_in_place(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # Rank 1 dies with its shard; its agent restarts it, the survivor keeps its process.
    # With copies every 4 steps, it dies as step 10's checkpoint begins, after the step's
    # commit: the survivor's planning collective fails after the step counted (the script
    # must not make a collective of the step's group after the block then: its new group's
    # member never ran the step), the save never commits, and rank 0 holds its own snapshot
    # of step 8 and rank 1's copy: the group goes back to step 8 from memory. With no
    # copies (it dies after step 13) every rank reads the step-10 checkpoint. Either way
    # the steps since are trained again, to the state the unfaulted run reaches (copies
    # and checkpoints change no state: one reference).
    crash = {**FSDP, "CRASH_IN_SAVE_AT_STEP": "10", "CRASH_RANK": "1"}
    from_copies = run_job(
        agents, etcd, tmp_path / "copies", crash, 2, "2", extra=("--copy-every=4",)
    )
    crash = {**FSDP, "CRASH_AT_STEP": "13", "CRASH_RANK": "1"}
    no_copies = ("--copy-every=0",)
    from_disk = run_job(agents, etcd, tmp_path / "disk", crash, 2, "2", extra=no_copies)
    reference = unfaulted_at_2(agents, etcd, tmp_path / "reference")

    assert "the group goes back to step 8, whose every shard a survivor holds" in from_copies
    found = re.search(r"^regrouped at step 8 \(shard copies at step 8\)", from_copies, re.M)
    assert found, from_copies[-3000:]
    assert re.search(r"^started \(shard copies at step 8\)", from_copies, re.M)
    assert "(checkpoint step" not in from_copies, "read from disk"
    assert_same_training(from_copies, reference)
    assert_every_sample_once_per_epoch(from_copies)

    assert "that held them; every rank reads the newest checkpoint" in from_disk
    found = re.search(r"^regrouped at step 10 \(checkpoint step 10\)", from_disk, re.M)
    assert found, from_disk[-3000:]
    assert re.search(r"^started \(checkpoint step 10\)", from_disk, re.M), from_disk[-3000:]
    assert_same_training(from_disk, reference)
    assert_every_sample_once_per_epoch(from_disk)


def test_an_fsdp_node_that_announces_its_departure_leaves_a_copy_of_its_shard_and_costs_no_step(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # Two nodes; after step 13 the agent of rank 1 gets SIGTERM (a drain). Both train
    # step 14 and agree to switch after it, and at its end the leaver's shard goes to its
    # buddy: rank 0 goes on alone at step 14 from memory, where the copies (every 10
    # steps) alone would have gone back to step 10. Reference: two nodes save step 14 and
    # stop, one resumes from it (DCP resharding to world 1).
    leave = {**FSDP, "LEAVE_AT_STEP": "14", "LEAVE_RANK": "1"}
    faulted = run_job(agents, etcd, tmp_path / "faulted", leave, 2, "1:2")
    first = run_job(agents, etcd, tmp_path / "reference", {**FSDP, "STOP_AT_STEP": "14"}, 2, "2")
    second = run_job(agents, etcd, tmp_path / "reference", FSDP, 1, "1")

    assert "departure: the workers have left; exiting" in faulted, faulted[-3000:]
    found = re.findall(r"^regrouped at step (\d+) \((.*?)\)", faulted, re.M)
    assert found == [("14", "shard copies at step 14")], found
    assert not re.search(r"step \d+ dropped", faulted), faulted[-3000:]
    assert re.search(r"^started \(checkpoint step 14\) .* world=1 ", second, re.M), second[-3000:]
    assert_same_training(faulted, first + second)
    assert_every_sample_once_per_epoch(faulted)


def test_a_whole_fsdp_job_told_to_stop_saves_its_last_step_and_resumes_from_it(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # After step 14 both agents get SIGTERM (the job deleted, or evicted): each stops its
    # worker. A rank told to stop votes so in its next step; the ranks agree on that step
    # and every rank writes its shards of it, so the job loses no step it committed. Run
    # again on the same checkpoint directory, it resumes there; the two runs together
    # train what an unfaulted run trains (the world is 2 throughout).
    stopped = run_job(
        agents, etcd, tmp_path / "job", {**FSDP, "STOP_JOB_AT_STEP": "14"}, 2, "2", expect_ok=False
    )
    said = {int(s) for s in re.findall(r"every rank saved step (\d+)", stopped)}
    assert len(said) == 1, stopped[-4000:]
    (saved,) = said
    # the step saved is the last committed: a rank told to stop exits inside its block,
    # before the script logs it (a rank told a moment later logs it first)
    logged = set(worlds(stopped))
    assert saved in (max(logged), max(logged) + 1) and saved >= 15, (saved, stopped[-3000:])
    resumed = run_job(agents, etcd, tmp_path / "job", FSDP, 2, "2")
    assert re.search(rf"^started \(checkpoint step {saved}\) ", resumed, re.M), resumed[-3000:]
    reference = unfaulted_at_2(agents, etcd, tmp_path / "reference")
    assert_same_training(stopped + resumed, reference, unlogged=frozenset({saved} - logged))


def test_fsdp_at_world_2_trains_what_one_process_trains_on_the_same_global_batch(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    sharded = tmp_path / "sharded.pt"
    extra = (*PLAIN_SGD, f"--dump={sharded}")
    run_job(agents, etcd, tmp_path / "two", FSDP, 2, "2", extra=extra)
    assert_trains_like_one_process(sharded, tmp_path, PLAIN_SGD, global_batch=16)
