"""bench.sharded: the FSDP2 group, ours in place beside the restart path and torchrun."""

from __future__ import annotations

from pathlib import Path

from bench import real_scripts, sharded
from bench.harness import Job
from bench.launchers import LAUNCHERS
from bench.real_scripts import Throughput
from bench.run import Result, summarize


def test_each_launcher_runs_the_script_written_for_it() -> None:
    assert sharded.script_for("elasticjob-run") == sharded.OURS_SCRIPT
    assert sharded.script_for("elasticjob-run-restart") == sharded.OURS_SCRIPT
    assert sharded.script_for("torchrun-c10d") == sharded.PLAIN_SCRIPT
    # the restart path is ours with in-place recovery off, and nothing else differs
    job = Job("elasticjob-run", Path("/unused"), "127.0.0.1:2379", "2:3", ["--steps=9"], "r1")
    ours = LAUNCHERS["elasticjob-run"].node(job, 0)
    restart = LAUNCHERS["elasticjob-run-restart"].node(job, 0)
    assert ours.argv == restart.argv
    assert restart.env == {"ELASTICJOB_IN_PLACE": "0"} and ours.env == {}


def test_the_group_expands_to_its_steady_states_and_its_four_faults() -> None:
    assert sharded.expand(["worker-kill", "fsdp", "fsdp-scale-up"]) == [
        "worker-kill",
        "fsdp-throughput",
        "fsdp-throughput-no-copies",
        "fsdp-throughput-saving",
        "fsdp-worker-kill",
        "fsdp-node-kill",
        "fsdp-scale-up",
        "hsdp-worker-kill",
    ]


def test_hsdp_runs_four_agents_on_a_2_x_2_mesh_under_ours_only() -> None:
    assert sharded.FAULTS["hsdp-worker-kill"] == "worker-kill-4"
    assert "--shard-group-size=2" in sharded.train_args("hsdp-worker-kill")
    assert not any(a.startswith("--shard-group") for a in sharded.train_args("fsdp-worker-kill"))
    assert sharded.runs_under("hsdp-worker-kill", "elasticjob-run-restart")
    assert not sharded.runs_under("hsdp-worker-kill", "torchrun-c10d")
    assert sharded.runs_under("fsdp-worker-kill", "torchrun-c10d")


def test_in_place_is_held_to_the_targets_beside_the_restart_path() -> None:
    results = [
        Result("elasticjob-run", "fsdp-worker-kill", 0, 1.5, 3, pause=2.0, step_time=0.9),
        Result("elasticjob-run-restart", "fsdp-worker-kill", 0, 6.0, 3, pause=6.5),
        Result("elasticjob-run", "fsdp-scale-up", 0, 9.0, 0, pause=1.2, step_time=0.9),
    ]
    launchers = ["elasticjob-run", "elasticjob-run-restart"]
    figs = {(f.scenario, f.metric): f for f in sharded.figures(summarize(results), launchers)}
    kill = figs[("fsdp-worker-kill", "SIGKILL a worker -> next step")]
    assert (kill.ours, kill.baseline, kill.target, kill.met) == ([1.5], [6.0], "<= 2 s", True)
    assert kill.baseline_name == "train_gpt_fsdp.py, in place off"
    join = figs[("fsdp-scale-up", "training paused (last step -> next step)")]
    assert (join.ours, join.target, join.met) == ([1.2], "<= 1.5 s", True)


def test_the_steady_state_window_holds_no_save_and_ends_before_the_run_does() -> None:
    args = dict(a.removeprefix("--").split("=", 1) for a in sharded.THROUGHPUT_ARGS)
    first, last = sharded.WINDOW
    assert int(args["checkpoint-interval"]) > last and int(args["steps"]) > last > first
    assert args["dim"] == "512" and args["log-every"] == "1"  # the faults' model, every step
    runs = [
        Throughput("elasticjob-run", 0, 9.9),
        Throughput("torchrun-c10d", 0, 10.0),
        Throughput("elasticjob-run-restart", 0, 10.0),
    ]
    fig = real_scripts.throughput_figure(sharded.STEADY, runs, "torchrun-c10d")
    assert (fig.scenario, fig.ratio, fig.met) == ("fsdp-throughput", 0.99, True)
    assert fig.baseline_name == "gpt_fsdp_plain.py, torchrun-c10d"
    restart = real_scripts.throughput_figure(sharded.STEADY, runs, "elasticjob-run-restart")
    assert restart.baseline_name == "train_gpt_fsdp.py, in place off"
    # the figure without copies turns them off under ours only (the plain script has none)
    assert sharded.STEADY_NO_COPIES.ours_args == ("--copy-every=0",)
    assert not sharded.STEADY.ours_args


def test_the_saving_window_saves_every_interval_inside_it_under_both_scripts() -> None:
    args = dict(a.removeprefix("--").split("=", 1) for a in sharded.SAVING_ARGS)
    first, last = sharded.WINDOW
    interval = int(args["checkpoint-interval"])
    assert interval == sharded.CHECKPOINT_INTERVAL and (last - first) // interval >= 4
    assert int(args["steps"]) > last
    assert sharded.STEADY_SAVING.ours_args == ()  # the same flags for both scripts
    runs = [Throughput("elasticjob-run", 0, 10.5), Throughput("torchrun-c10d", 0, 10.0)]
    fig = real_scripts.throughput_figure(sharded.STEADY_SAVING, runs, "torchrun-c10d")
    assert (fig.scenario, fig.ratio, fig.met) == ("fsdp-throughput-saving", 1.05, True)
