"""HSDP elastic in place: examples/train_gpt_fsdp.py with ``--shard-group-size=2`` (a
2-D ``(replicate, shard)`` mesh) under the real launcher, real etcd and real torch
workers over gloo, two workers a node.

Proven by comparison, at every step, with fingerprints of the whole model and optimizer
that depend neither on the world size nor on the mesh:

* a second replica joins (world 2 = one group of 2, to 4 = 2 x 2): the joiners receive
  their shards from the first replica's memory, and the run trains what a DCP save at
  world 2 and a load at world 4 train;
* a killed worker costs no step: another replica holds its shard, so the group regroups
  at the step it reached, from memory (no shard copy, no checkpoint), and trains what the
  unfaulted run trains;
* a replica whose shard no longer matches its peer's is found by the divergence guard,
  which compares the ranks that hold one shard, and ``resync`` mends it;
* HSDP at world 4 trains, within float tolerance, what one process trains on the same
  global batch (the shard group sums, the replicas sum, FSDP2 divides by all four).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import EtcdServer, result_of
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
HSDP = ("--shard-group-size=2",)


def test_an_hsdp_replica_joins_from_memory_and_trains_what_a_dcp_reshard_trains(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # In place: one node of two workers (one shard group) to step 12; a second node of
    # two joins while the group holds, as a second replica. Reference: world 2 saves
    # step 12 (DCP) and stops; two nodes resume from it at 2 x 2.
    join = {**FSDP, "HOLD_AT_STEP": "12", "HOLD_WORLD": "2"}
    joined = run_job(
        agents,
        etcd,
        tmp_path / "joined",
        join,
        1,
        "1:2",
        "held before step 12",
        extra=HSDP,
        nproc=2,
    )
    stop = {**FSDP, "STOP_AT_STEP": "12"}
    first = run_job(agents, etcd, tmp_path / "reference", stop, 1, "1", extra=HSDP, nproc=2)
    second = run_job(agents, etcd, tmp_path / "reference", FSDP, 2, "2", extra=HSDP, nproc=2)

    assert len(re.findall(r"^regrouped at step 12 \(own memory at step 12\)", joined, re.M)) == 2
    joiners = re.findall(r"^started \(rank \d at step 12\) .* world=4 ", joined, re.M)
    assert len(joiners) == 2, joined[-3000:]
    assert re.search(r"^started \(checkpoint step 12\) .* world=4 ", second, re.M), second[-3000:]
    assert {w for w in worlds(joined).values()} == {2, 4}
    assert_same_training(joined, first + second)
    assert_every_sample_once_per_epoch(joined)


def test_a_killed_hsdp_worker_costs_no_step_and_hsdp_trains_what_one_process_trains(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # 2 x 2 over two nodes; rank 1 dies after step 14 with its shard, which the other
    # replica holds. No shard copies, no checkpoint since step 10: only the replica can
    # bring step 14 back. Plain SGD, so that the unfaulted run also compares with one
    # process on the same global batch.
    same = (*HSDP, *PLAIN_SGD, "--copy-every=0")
    crash = {**FSDP, "CRASH_AT_STEP": "14", "CRASH_RANK": "1"}
    faulted = run_job(agents, etcd, tmp_path / "faulted", crash, 2, "2", extra=same, nproc=2)
    sharded = tmp_path / "sharded.pt"
    dump = (*same, f"--dump={sharded}")
    reference = run_job(agents, etcd, tmp_path / "reference", FSDP, 2, "2", extra=dump, nproc=2)

    # the killed worker's agent restarts both its workers (a whole replica): the other
    # node's two regroup from their own memory and the restarted two take their shards
    found = re.findall(r"^regrouped at step 14 \((.*?)\)", faulted, re.M)
    assert found == ["own memory at step 14"] * 2, found
    restarted = re.findall(r"^started \(rank \d at step 14\) .* world=4 ", faulted, re.M)
    assert len(restarted) == 2, faulted[-3000:]
    assert "checkpoint step" not in faulted and "shard copies" not in faulted
    assert_same_training(faulted, reference)
    assert_every_sample_once_per_epoch(faulted)

    # the 2 x 2 run's last DCP checkpoint (each replica writing part of each shard: DCP
    # spreads the duplicates) holds, read whole in one process, the model it dumped
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(tmp_path / "reference" / "ckpt" / "sharded-0000000040", whole)
    saved, dumped = torch.load(whole)["model"], torch.load(sharded)
    assert {k: v for k, v in dumped.items() if k in saved}.keys() == saved.keys()
    assert all(torch.equal(saved[k], dumped[k]) for k in saved), "the checkpoint differs"

    assert_trains_like_one_process(sharded, tmp_path, same, global_batch=32)


def test_a_replica_whose_shard_differs_is_found_and_resynced(
    agents: list[subprocess.Popen[bytes]], etcd: EtcdServer, tmp_path: Path
) -> None:
    # 2 x 2: rank 3 (shard 1 of the second replica) changes its shard after step 5; the
    # check after step 6 compares it with rank 1, which holds shard 1 too, and copies
    # rank 1's over it; the checks after 9, 12, ... find the replicas alike again.
    env = {
        **FSDP,
        "TAMPER_AT_STEP": "5",
        "TAMPER_RANK": "3",
        "CHECK_EVERY": "3",
        "ON_DIVERGENCE": "resync",
    }
    logs = run_job(agents, etcd, tmp_path, env, 2, "2", extra=HSDP, nproc=2)
    said = r"at step (\d+) \([^)]*\) (.*?)\. HSDP replicas .*; copying rank 0's state"
    found = set(re.findall(said, logs))  # every rank says it
    assert found == {("6", "'shards of shard 1' differs (ranks [1] vs [3])")}, found
    assert result_of(logs)["steps"] == 40
