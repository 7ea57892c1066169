"""bench.real_scripts and bench.check_cost: how the realistic script's figures are read."""

from __future__ import annotations

import pytest

from bench import check_cost, phases, real_scripts
from bench.goodput import Goodput
from bench.harness import parse_regroups
from bench.real_scripts import Progress, Throughput, parse_progress, window_rate
from bench.run import Result, summarize, table

GPT_LINE = "step=20 epoch=0 loss=6.3264 lr=3.000e-04 world=2 rank=0 samples=640 pid=77 t=100.000"
PLAIN_LINE = "step=20 epoch=0 loss=6.3264 world=2 rank=0 samples=640 pid=78 t=100.000"


def test_both_scripts_step_lines_give_the_samples_trained() -> None:
    assert parse_progress([GPT_LINE, "started (fresh) at step 0 world=2 t=1.0"]) == [
        Progress(step=20, world=2, samples=640, pid=77, t=100.0)
    ]
    assert parse_progress([PLAIN_LINE]) == [Progress(20, 2, 640, 78, 100.0)]


def test_throughput_is_samples_over_seconds_between_the_window_ends() -> None:
    # 32 samples a step (8 x 2 micro-batches x 2 ranks), 0.1 s a step
    steps = [Progress(i, 2, 32 * i, 7, 100.0 + 0.1 * i) for i in range(1, 131)]
    assert window_rate(steps, 20, 120) == pytest.approx(320.0)
    assert window_rate(steps, 20, 140) is None  # the window's end was never logged
    # a restart inside the window (another pid, or another world) is not steady training
    restarted = [*steps[:50], *(Progress(i, 2, 32 * i, 9, 200.0 + 0.1 * i) for i in range(51, 130))]
    assert window_rate(restarted, 20, 120) is None
    with pytest.raises(ValueError):
        window_rate(steps, 120, 20)


def test_the_typical_step_is_the_median_gap_of_one_process_inside_the_window() -> None:
    steps = [Progress(i, 2, 32 * i, 7, 100.0 + 0.1 * i) for i in range(1, 30)]
    steps[15] = Progress(16, 2, 512, 7, 103.0)  # one slow step (a neighbour's burst)
    assert real_scripts.median_gap(steps, 5, 25) == pytest.approx(0.1)
    assert real_scripts.median_gap(steps, 40, 50) is None


def test_processes_of_a_job_are_told_apart_by_command_line() -> None:
    script = "train_gpt.py"
    assert real_scripts.role("python -u /r/examples/train_gpt.py --steps=9", script) == "worker"
    spare = "python -u -m elasticjob_runtime.launch.spare --fd=10 --parent=3"
    assert real_scripts.role(spare, script) == "spare"
    # the agents name the script too
    torchrun = "python -m torch.distributed.run --nnodes=2 /r/bench/train_gpt.py"
    assert real_scripts.role(torchrun, script) == "agent"
    ours = "python -m elasticjob_runtime.launch.launcher --nnodes=2 /r/examples/train_gpt.py"
    assert real_scripts.role(ours, script) == "agent"
    resource = "python -c from multiprocessing.resource_tracker import main"
    assert real_scripts.role(resource, script) == "other"


def test_cpu_by_role_counts_what_each_role_used_between_snapshots() -> None:
    before = {1: ("agent", 5.0), 2: ("worker", 10.0), 3: ("spare", 4.0)}
    after = {1: ("agent", 5.5), 2: ("worker", 30.0), 4: ("loader", 1.25), 5: ("loader", 0.75)}
    assert real_scripts.cpu_by_role(before, after) == {
        "agent": 0.5,
        "loader": 2.0,
        "worker": 20.0,
    }


def test_a_throughput_figure_is_ours_over_the_baseline_against_its_target() -> None:
    runs = [
        Throughput("elasticjob-run", 0, 99.5, cpu={"worker": 50.0, "agent": 1.0}),
        Throughput("torchrun-c10d", 0, 100.0, cpu={"worker": 49.0, "agent": 0.2}),
        Throughput("elasticjob-run", 1, 98.0),
        Throughput("torchrun-c10d", 1, 100.0),
        Throughput("elasticjob-run", 2, error="timed out"),
    ]
    fig = real_scripts.throughput_figure(real_scripts.GPT_STEADY, runs, "torchrun-c10d")
    assert fig.ours == [99.5, 98.0] and fig.baseline == [100.0, 100.0]
    assert fig.ratio == pytest.approx(0.9875) and fig.met is False
    assert fig.failures == ["elasticjob-run: timed out"]
    assert "0.995, 0.980" in fig.note
    # per step of the 100-step window, the median over the repetitions that have it
    assert "agent 10 vs 2, worker 500 vs 490" in fig.note


def test_host_steal_is_the_share_of_the_machines_cpu_time_the_host_took() -> None:
    before = real_scripts.machine_cpu_times("cpu  100 0 20 70 0 0 0 10 5 0\ncpu0 1 2 3\n")
    after = real_scripts.machine_cpu_times("cpu  160 0 30 90 0 0 0 40 25 0\n")
    assert before == [100, 0, 20, 70, 0, 0, 0, 10, 5, 0]
    # 120 ticks passed, 30 of them stolen; guest time is inside user already
    assert real_scripts.steal_percent(before, after) == 25.0
    assert real_scripts.steal_percent(before, before) is None  # no time between
    assert real_scripts.steal_percent(None, after) is None
    assert real_scripts.machine_cpu_times("intr 1 2 3\n") is None
    assert real_scripts.machine_cpu_times() is not None  # this machine's own /proc/stat


def test_a_throughput_figure_shows_each_repetitions_host_steal() -> None:
    runs = [
        Throughput("elasticjob-run", 0, 99.0, steal=4.2),
        Throughput("torchrun-c10d", 0, 100.0, steal=0.3),
        Throughput("elasticjob-run", 1, 98.0),
        Throughput("torchrun-c10d", 1, 100.0, steal=0.0),
    ]
    fig = real_scripts.throughput_figure(real_scripts.GPT_STEADY, runs, "torchrun-c10d")
    # the second repetition has no reading for ours: left out, not guessed
    assert fig.note.endswith("host steal % per repetition, ours vs baseline: 4.2 vs 0.3")


def test_the_group_name_expands_to_its_scenarios_once() -> None:
    assert real_scripts.expand(["worker-kill", "real-scripts", "check-cost"]) == [
        "worker-kill",
        "gpt-throughput",
        "gpt-worker-kill",
        "gpt-scale-up",
        "check-cost",
        "ledger-cost",
    ]
    assert "gpt-goodput" not in real_scripts.expand(["real-scripts"])


def test_each_launcher_runs_its_own_version_of_the_script() -> None:
    assert real_scripts.script_for("elasticjob-run").name == "train_gpt.py"
    assert real_scripts.script_for("torchrun-c10d").name == "gpt_plain.py"
    assert real_scripts.script_for("torchrun-etcd-v3").name == "gpt_plain.py"


def test_regroup_lines_are_read_with_or_without_a_startup_part() -> None:
    lines = [
        "regrouped at step 41 (rank 1 at step 41) world=2 rank=0 t=12.5",  # train_gpt
        "regrouped at step 42 (own memory at step 42) world=2 rank=0 restarts=0 "
        "startup=0.30s(imports=0.00,process_group=0.10,ddp=0.02,restore=0.03) start=in-place "
        "t=13.0",  # train_regression
        "step=41 epoch=0 loss=1 world=2 rank=0 samples=1 pid=3 t=14.0",
    ]
    assert parse_regroups(lines) == [12.5, 13.0]


def test_a_script_without_startup_lines_gets_the_coarse_phases() -> None:
    lines = [
        "I0102 10:00:01.250000 77 torch/distributed/elastic/agent/server/api.py:1] "
        "[default] Stopping worker group",
        "I0102 10:00:01.600000 77 torch/distributed/elastic/agent/server/api.py:1] "
        "[default] Starting worker group",
    ]
    events = phases.agent_events(lines, 2027)
    base = events[0].t - 1.25  # 10:00:00 local time
    ready = phases.ready_marks(
        [
            f"started (rank 1 at step 41) at step 41 world=2 rank=0 pid=5 t={base + 1.9}",
            f"regrouped at step 41 (own memory at step 41) world=2 rank=1 t={base + 2.0}",
            "started without a time",
        ]
    )
    assert ready == [pytest.approx(base + 1.9), pytest.approx(base + 2.0)]
    split = phases.coarse_breakdown(base + 1.0, [events], ready[-1], base + 2.5)
    assert split == pytest.approx(
        {"detect": 0.25, "rendezvous": 0.35, "ready": 0.4, "first_step": 0.5}
    )
    # gpt_plain.py logs no ready mark: everything after the rendezvous is the first step
    plain = phases.coarse_breakdown(base + 1.0, [events], None, base + 2.5)
    assert plain == pytest.approx({"detect": 0.25, "rendezvous": 0.35, "first_step": 0.9})
    assert phases.coarse_breakdown(base + 5.0, [events], None, base + 6.0) is None


def test_the_table_shows_the_real_script_rows_with_their_coarse_phases() -> None:
    coarse = {"detect": 0.1, "rendezvous": 0.2, "ready": 0.3, "first_step": 0.4}
    plain = {"detect": 0.1, "rendezvous": 2.0, "first_step": 5.0}
    results = [
        Result(
            "elasticjob-run", "gpt-worker-kill", 0, 0.9, pause=1.0, phases=coarse, step_time=0.3
        ),
        Result("torchrun-c10d", "gpt-worker-kill", 0, 7.1, pause=7.2, phases=plain, step_time=0.25),
    ]
    summary = summarize(results)
    assert summary["torchrun-c10d"]["gpt-worker-kill"]["phases_median"] == plain
    goodputs = [Goodput("elasticjob-run", "gpt-goodput", goodput=0.991)]
    text = table(summary, ["elasticjob-run", "torchrun-c10d"], goodputs)
    assert "train_gpt / gpt_plain: SIGKILL a worker -> next step" in text
    assert "detect/rendezvous/ready/step" in text
    assert "0.1/0.2/0.3/0.4" in text and "0.1/2.0/-/5.0" in text
    assert "train_gpt / gpt_plain: goodput" in text and "99.1%" in text

    figures = real_scripts.fault_figures(summary, ["elasticjob-run", "torchrun-c10d"])
    kill = [f for f in figures if f.scenario == "gpt-worker-kill"]
    assert [(f.metric.split()[0], f.ours, f.baseline, f.met) for f in kill] == [
        ("SIGKILL", [0.9], [7.1], True),
        ("training", [1.0], [7.2], True),
    ]
    assert kill[0].ratio == pytest.approx(0.9 / 7.1)
    assert "0.30 s (ours), 0.25 s (baseline)" in kill[1].note
    assert not [f for f in figures if f.scenario == "gpt-scale-up"]  # not run


def test_a_goodput_figure_puts_ours_beside_the_plain_script() -> None:
    goodputs = [
        Goodput("elasticjob-run", "gpt-goodput", window=300.0, goodput=0.985),
        Goodput("torchrun-c10d", "gpt-goodput", window=300.0, goodput=0.7),
        Goodput("elasticjob-run", "goodput", window=300.0, goodput=0.96),  # the other script
    ]
    (fig,) = real_scripts.goodput_figures(goodputs, ["elasticjob-run", "torchrun-c10d"])
    assert fig.ours == [pytest.approx(98.5)] and fig.baseline == [pytest.approx(70.0)]
    assert fig.met is False and "5.0 min" in fig.metric


def test_a_cost_paid_every_n_steps_is_a_share_of_each_step() -> None:
    # a 2 ms check every 100 steps of 4 ms: 0.5 % of a step
    assert check_cost.per_step(0.002, 100, 0.004) == pytest.approx(0.5)
    assert check_cost.per_step(0.00001, 1, 0.002) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        check_cost.per_step(0.002, 0, 0.004)


def test_check_cost_figures_hold_the_target_and_the_times_behind_them() -> None:
    sample = check_cost.Sample(
        "train_regression",
        check_every=100,
        step=0.002,
        voted_step=0.00201,
        check=0.001,
        fingerprint=0.0004,
        gather=0.0003,
        seed=0.00001,
        vote=0.0001,
        objects=5,
    )
    check, seed, vote = check_cost.figures([sample], [], "train_regression")
    assert check.ours == [0.5] and check.met is True and check.target == "< 1 %"
    assert seed.ours == [0.5] and "every 100 steps" in check.metric
    assert vote.ours == [0.5] and "switch vote" in vote.metric
    assert "step 2 ms" in check.note and "check 1 ms" in check.note
    assert "a step that votes 2.01 ms, the vote alone 0.1 ms" in vote.note
    (failed, _, _) = check_cost.figures([], ["timed out"], "train_gpt")
    assert failed.ours == [] and failed.met is None and failed.failures == ["timed out"]


def test_the_default_check_interval_is_the_runtimes() -> None:
    pytest.importorskip("torch")
    from elasticjob_runtime import Run

    assert check_cost.default_check_every() == Run.__init__.__kwdefaults__["check_every"]
