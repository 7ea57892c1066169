"""bench.launchers: each peer one module behind one Protocol, and how the bench reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import torchft_regression
from bench.harness import Job, StepLine, parse_regroups, parse_step_line
from bench.launchers import LAUNCHERS, Launcher, Workload, scripts
from bench.launchers.namespace import namespace_of
from bench.launchers.torchft import Torchft, lighthouse_command, most_nodes
from bench.run import TRAIN_ARGS, longest_pause, steps_redone


def _job(launcher: str, nnodes: str = "2:3") -> Job:
    return Job(launcher, Path("/unused"), "127.0.0.1:2379", nnodes, ["--steps=9"], "r1")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_every_launcher_is_one_under_its_own_name(name: str) -> None:
    launcher: Launcher = LAUNCHERS[name]
    assert launcher.name == name
    assert launcher.script(Workload.REGRESSION) is not None  # every peer runs the regression


def test_ours_and_torchrun_run_the_same_regression_script_and_torchft_its_own_of_each() -> None:
    assert LAUNCHERS["elasticjob-run"].script(Workload.REGRESSION) == scripts.REGRESSION
    assert LAUNCHERS["torchrun-c10d"].script(Workload.REGRESSION) == scripts.REGRESSION
    assert LAUNCHERS["torchft"].script(Workload.REGRESSION) == scripts.REGRESSION_TORCHFT
    assert LAUNCHERS["torchft"].script(Workload.GPT) == scripts.GPT_TORCHFT
    assert LAUNCHERS["torchft"].script(Workload.CLASSIC) is None  # a torchelastic script


def test_a_torchft_node_is_a_replica_group_under_its_own_torchrun_in_the_jobs_namespace() -> None:
    job = _job("torchft")
    node = Torchft().node(job, 2)
    assert node.argv[:4] == ["ip", "netns", "exec", namespace_of(job)]
    assert "--nnodes=1" in node.argv and "--master-port=29602" in node.argv
    assert f"--max-restarts={job.max_restarts}" in node.argv  # its torchrun restarts it
    assert node.env["REPLICA_GROUP_ID"] == "2"
    assert node.env["NUM_REPLICA_GROUPS"] == "3"  # the most groups the job may have
    assert node.env["TORCHFT_LIGHTHOUSE"] == job.rdzv_endpoint
    assert most_nodes("2") == 2


def test_the_lighthouse_is_the_readmes_on_loopback_with_its_default_heartbeat_or_a_tuned_one() -> (
    None
):
    default = lighthouse_command(None)
    assert "--bind=127.0.0.1:29510" in default and "--min_replicas=1" in default
    assert not any(a.startswith("--heartbeat_timeout_ms") for a in default)
    assert "--heartbeat_timeout_ms=1000" in lighthouse_command(1000)
    assert Torchft(1000).name == "torchft-hb1000ms"


def test_the_torchft_script_takes_the_flags_the_bench_passes_and_prints_its_lines() -> None:
    args = torchft_regression.parse(TRAIN_ARGS)
    assert (args.steps, args.log_every, args.batch_size) == (1000000, 1, 32)
    line = "step=186 epoch=0 loss=0.15999 world=2 samples=160 pid=9164 t=1795748650.102"
    assert parse_step_line(line) == StepLine(186, 2, 9164, 1795748650.102)
    assert parse_regroups(["regrouped at step 7 world=1 t=12.500"]) == [12.5]


def test_the_pause_is_the_longest_stretch_without_a_step_whoever_logged_it() -> None:
    steps = [
        StepLine(10, 2, pid=1, t=9.0),
        StepLine(10, 2, pid=2, t=9.01),  # a second replica group logs the same step
        StepLine(11, 2, pid=1, t=14.0),  # the survivor, once the quorum re-formed
        StepLine(11, 2, pid=3, t=14.01),  # the restarted group: the step that counts
        StepLine(12, 2, pid=3, t=14.2),
    ]
    assert longest_pause(steps, 10.0, steps[3]) == 4.99
    # a restart that trains a step again: training resumed at the redone step
    redone = [StepLine(10, 2, 1, 9.0), StepLine(11, 2, 1, 9.5), StepLine(9, 2, 5, 13.0)]
    assert longest_pause(redone, 10.0, redone[2]) == 3.5
    assert longest_pause(redone[2:], 10.0, redone[2]) is None  # no step before the fault


def test_one_step_logged_by_two_replica_groups_is_not_a_step_redone() -> None:
    # torchft: a join; the survivor (pid 1) and the joiner (pid 3) both log step 11
    steps = [StepLine(10, 2, 1, 9.0), StepLine(11, 3, 1, 12.99), StepLine(11, 3, 3, 13.0)]
    assert steps_redone(steps, {1}, 10.0, steps[2]) == 0
