"""The benchmark's measurement rules: which logged step counts as "training again"."""

from __future__ import annotations

import pytest

from bench.harness import StepLine, first_step_after, parse_startups, parse_step_line
from bench.run import Result, summarize, table

LINE = "step=41 epoch=0 loss=0.2096 world=2 rank=0 restarts=1 samples=3200 pid=77 t=100.500"


def test_a_step_line_of_the_example_is_parsed() -> None:
    assert parse_step_line(LINE) == StepLine(step=41, world=2, pid=77, t=100.5)
    assert parse_step_line("resumed from step 40 world=2 t=1.0") is None
    assert parse_step_line("[rank0]: step=3 world=2 pid=1 t=2.0 Traceback") is None


def test_a_step_an_old_worker_finishes_after_the_fault_does_not_count_as_recovery() -> None:
    steps = [
        StepLine(10, 3, pid=1, t=9.0),
        StepLine(11, 3, pid=1, t=10.2),  # in flight when the fault hit at t=10
        StepLine(9, 2, pid=5, t=14.0),  # the restarted group, resumed from a checkpoint
        StepLine(10, 2, pid=5, t=14.1),
    ]
    after = first_step_after(steps, 10.0, old_pids={1}, world=2)
    assert after == StepLine(9, 2, pid=5, t=14.0)
    assert first_step_after(steps, 10.0, old_pids={1, 5}) is None
    assert first_step_after(steps, 10.0, old_pids={1}, world=3) is None
    # A survivor that regrouped in place at t=11 counts from then on, at the new size.
    survivor = [*steps[:2], StepLine(11, 2, pid=1, t=11.3)]
    assert first_step_after(survivor, 10.0, {1}, 2, regrouped_at=11.0) == survivor[2]
    assert first_step_after(survivor, 10.0, {1}, 2) is None


def test_worker_startup_lines_are_read_with_their_time() -> None:
    lines = [
        "resumed from step 40 (/x) world=2 rank=0 restarts=1 "
        "startup=3.77s(imports=2.36,process_group=0.05,ddp=1.35,restore=0.01) t=12.5",
        LINE,
    ]
    assert parse_startups(lines) == [(12.5, 3.77)]


def test_summary_keeps_failures_apart_from_timings() -> None:
    results = [
        Result("elasticjob-run", "node-kill", 0, seconds=5.0, steps_redone=3, pause=5.2),
        Result("elasticjob-run", "node-kill", 1, seconds=7.0, steps_redone=1, pause=7.2),
        Result("torchrun-c10d", "node-kill", 0, error="no step within 150s"),
    ]
    summary = summarize(results)
    ours = summary["elasticjob-run"]["node-kill"]
    assert (ours["median"], ours["min"], ours["max"], ours["n"]) == (6.0, 5.0, 7.0, 2)
    assert summary["torchrun-c10d"]["node-kill"]["failures"] == ["no step within 150s"]
    text = table(summary, ["elasticjob-run", "torchrun-c10d"])
    assert "6.0 s (5.0-7.0, n=2)" in text and "failed (1)" in text and "6.2 s" in text


def test_a_run_that_never_recovers_shows_as_a_lower_bound_not_a_time() -> None:
    results = [
        Result("torchrun-c10d", "node-freeze", 0, error="no step", gave_up_after=150.0),
        Result("elasticjob-run", "node-freeze", 0, seconds=4.2),
    ]
    text = table(summarize(results), ["elasticjob-run", "torchrun-c10d"])
    assert "> 150 s (no step, n=1)" in text and "4.2 s" in text


def test_recovery_phases_come_from_torch_agent_lines_and_the_startup_line() -> None:
    from bench import phases

    lines = [
        "I0102 10:00:01.250000 77 torch/distributed/elastic/agent/server/api.py:1] "
        "[default] Stopping worker group",
        "I0102 10:00:01.600000 77 torch/distributed/elastic/agent/server/api.py:1] "
        "[default] Starting worker group",
        "W0102 10:00:09.000000 77 torch/x.py:1] unrelated",
    ]
    events = phases.agent_events(lines, 2027)
    assert [e.what for e in events] == ["stopping", "starting"]
    base = events[0].t - 1.25  # 10:00:00 local time
    up = phases.startups(
        [
            "resumed from step 40 (x) world=2 rank=0 restarts=1 startup=0.30s(imports=0.01,"
            f"process_group=0.15,ddp=0.05,restore=0.04) start=warm t={base + 2.0}"
        ]
    )[0]
    split = phases.breakdown(base + 1.0, [events], up, base + 2.1)
    assert split == {
        "detect": 0.25,
        "rendezvous": 0.35,
        "worker_ready": 0.16,
        "process_group": 0.2,
        "restore": 0.04,
        "first_step": 0.1,
    }
    assert phases.breakdown(base + 5.0, [events], up, base + 6.0) is None  # no reaction seen


def test_an_in_place_regroup_is_read_from_our_agent_line_and_the_regroup_line() -> None:
    from bench import phases

    lines = [
        "[2027-01-02 10:00:01,250] elasticjob_runtime.launch.agent: regrouping the running workers "
        "in place (the round lost ['n2']: they abandon its collectives)",
        "[2027-01-02 10:00:01,300] elasticjob_runtime.launch.agent: something else",
        "I0102 10:00:01.400000 77 torch/distributed/elastic/agent/server/api.py:1] "
        "[default] Starting worker group",
    ]
    events = phases.agent_events(lines, 2027)
    assert [e.what for e in events] == ["stopping", "starting"]
    base = events[0].t - 1.25
    up = phases.startups(
        [
            "regrouped at step 41 (rank 1 at step 41) world=2 rank=0 restarts=0 startup=0.30s("
            f"imports=0.00,process_group=0.10,ddp=0.02,restore=0.03) start=in-place t={base + 1.6}"
        ]
    )[0]
    split = phases.breakdown(base + 1.0, [events], up, base + 1.7)
    assert split is not None
    assert split["detect"] == 0.25 and split["rendezvous"] == 0.15
    assert split["process_group"] == pytest.approx(0.12) and split["restore"] == 0.03


def test_goodput_counts_net_new_steps_at_the_steady_step_time() -> None:
    from bench.goodput import goodput, steady_step_time

    steps = [StepLine(i, 2, 1, 100.0 + 0.1 * i) for i in range(50)]  # 0.1 s per step
    steps += [StepLine(40 + i, 2, 2, 106.0 + 0.1 * i) for i in range(20)]  # redid 40..49
    assert steady_step_time(steps, 104.0) == pytest.approx(0.1)
    gained, share = goodput(steps, 104.0, 108.0, 0.1)
    # at 104.0 the newest step was 40 (t=104.0); at 108.0 it is 59 (t=107.9)
    assert gained == 59 - 40 and share == pytest.approx(19 * 0.1 / 4.0)


def test_the_steady_step_is_the_windows_own_when_the_machine_speeds_up() -> None:
    from bench.goodput import steady_step_time

    slow = [StepLine(i, 2, 1, 100.0 + 0.4 * i) for i in range(10)]  # settling: 0.4 s a step
    fast = [StepLine(10 + i, 2, 1, 104.0 + 0.3 * i) for i in range(40)]  # the window: 0.3 s
    stall = [StepLine(50, 2, 1, 118.0)]  # a fault's pause, one gap of many
    steps = slow + fast + stall
    assert steady_step_time(steps, 104.0) == pytest.approx(0.4)
    assert steady_step_time(steps, 120.0, since=104.0) == pytest.approx(0.3)


def test_goodput_by_share_counts_a_step_a_lone_survivor_trained_as_half_a_step() -> None:
    from bench.goodput import goodput_by_share

    steps = [StepLine(i, 2, 1, 100.0 + 0.1 * i) for i in range(1, 11)]  # both groups
    steps += [StepLine(10 + i, 1, 1, 101.0 + 0.1 * i) for i in range(1, 11)]  # one alone
    steps += [StepLine(20 + i, 2, 1, 102.0 + 0.1 * i) for i in range(1, 11)]  # both again
    steps += [StepLine(25, 2, 2, 102.55)]  # a step logged again is not new
    share = goodput_by_share(steps, 100.0, 103.0, 0.1, full=2)
    assert share == pytest.approx((10 + 10 * 0.5 + 10) * 0.1 / 3.0, abs=1e-4)


def test_lost_time_charges_each_slow_gap_to_its_fault_save_or_spare() -> None:
    from bench.goodput import LostTime, lost_time

    step = 1.0
    timeline = [(float(t), t) for t in range(0, 20)]  # steady: a step a second to step 19
    timeline += [(19.5, 19), (23.0, 20)]  # a fault at 20.0: 3 s more, the other rank's line
    timeline += [(24.5, 21), (25.5, 22), (27.0, 23)]  # slower after it: 0.5, 0, 0.5 more
    timeline += [(39.0, 35), (40.3, 36), (41.8, 37)]  # the save at 36 and the next: 0.3, 0.5
    timeline += [(42.6, 38), (44.2, 39)]  # noise: -0.2, 0.6
    timeline += [(60.0, 40)]  # the last gap ends past the window
    lost = lost_time(timeline, [20.0], step, window=55.0, checkpoint_interval=12)
    assert lost == LostTime(
        pauses=3.0, checkpoints=0.8, after_faults=1.0, other=0.4, in_flight=1.0
    )  # step 20, begun at 19.0 (rank 0's line), ran a whole steady step before the kill


def test_the_step_in_flight_at_a_kill_counts_at_most_one_steady_step() -> None:
    from bench.goodput import lost_time

    timeline = [(0.0, 0), (1.0, 1), (4.0, 2), (5.0, 3)]  # a 2 s stall, then a kill at 3.5
    lost = lost_time(timeline, [3.5], 1.0, window=10.0, checkpoint_interval=None)
    assert (lost.pauses, lost.in_flight) == (2.0, 1.0)
