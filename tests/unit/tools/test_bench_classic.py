"""bench.classic and its phase split: an unchanged classic script's restart, read from logs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import cast

import pytest

from bench import classic, phases
from bench.harness import Agent, Job, StepLine, parse_step_line, parse_steps
from bench.run import Result, recovery_phases, steps_redone, summarize, table

T0 = 1_800_000_000.0  # the fault, unix seconds


def glog(t: float, message: str) -> str:
    """A torch agent's log line (glog-style prefix, local time) at unix time ``t``."""
    local = time.localtime(t)
    micros = round((t - int(t)) * 1e6)
    stamp = time.strftime("%m%d %H:%M:%S", local) + f".{micros:06d}"
    return f"I{stamp} 77 torch/distributed/elastic/agent/server/api.py:1] [default] {message}"


def marks(pid: int, start: float, *gaps: float) -> list[str]:
    """The script's ``startup phase=`` lines: ``imports`` at ``start``, then the next mark
    of :data:`phases.SCRIPT_MARKS` after each gap (fewer gaps: a worker that stopped)."""
    lines, t = [], start
    for name, gap in zip(phases.SCRIPT_MARKS, (0.0, *gaps), strict=False):
        t += gap
        lines.append(f"startup phase={name} pid={pid} t={t:.3f}")
    return lines


def test_the_script_start_up_marks_are_read_per_process() -> None:
    lines = [
        "startup phase=imports pid=5 t=10.000",
        "step=41 epoch=0 loss=6.9 world=2 rank=0 pid=5 t=12.000",
        "startup phase=process_group pid=5 t=10.250",
        "startup phase=imports pid=6 t=10.100",
        "startup=0.30s(imports=0.01,process_group=0.15,ddp=0.05,restore=0.04) t=3.0",
        "[rank1]: startup phase=model pid=6 t=11.0",  # not the script's own line
        "startup phase=imports pid=5 t=20.000",  # a reused pid: the later mark
    ]
    assert phases.script_marks(lines) == {
        5: {"imports": 20.0, "process_group": 10.25},
        6: {"imports": 10.1},
    }


def test_a_restart_splits_into_the_launchers_phases_and_the_scripts_own() -> None:
    # two agents; the victim's agent reacts first, the other starts its worker last
    a = [glog(T0 + 0.1, "Stopping worker group"), glog(T0 + 0.3, "Starting worker group")]
    b = [glog(T0 + 0.2, "Stopping worker group"), glog(T0 + 0.4, "Starting worker group")]
    # worker 5 (agent a) is quick to import; worker 6 (agent b) is the last at every mark
    a += marks(5, T0 + 0.45, 0.2, 0.1, 0.1, 0.05, 0.3)
    b += marks(6, T0 + 0.5, 0.25, 0.2, 0.15, 0.1, 0.4)
    per_agent = [(phases.agent_events(x, 2027), phases.script_marks(x)) for x in (a, b)]
    split = phases.classic_breakdown(T0, per_agent, T0 + 2.0)
    assert split == pytest.approx(
        {
            "detect": 0.1,  # -> the first agent stops its workers
            "rendezvous": 0.3,  # -> the last agent starts its workers (T0 + 0.4)
            "worker_start": 0.1,  # -> the last imports mark (T0 + 0.5)
            "process_group": 0.25,
            "model": 0.2,
            "checkpoint": 0.15,
            "ddp": 0.1,
            "loader": 0.4,  # T0 + 1.6
            "first_step": 0.4,
        },
        abs=2e-3,
    )
    assert list(split) == list(phases.CLASSIC)
    assert sum(split.values()) == pytest.approx(2.0, abs=5e-3)


def test_only_the_last_round_s_workers_count_and_a_lost_agent_is_skipped() -> None:
    # agent a restarted twice (its first new worker died in the broken round); agent c
    # was the lost node: it logged its worker's marks from the start of the job only
    a = [
        glog(T0 + 0.1, "Stopping worker group"),
        glog(T0 + 0.2, "Starting worker group"),
        *marks(5, T0 + 0.3, 0.1),  # the aborted round's worker: imports and pg only
        glog(T0 + 1.0, "Stopping worker group"),
        glog(T0 + 1.5, "Starting worker group"),
        *marks(7, T0 + 1.6, 0.1, 0.1, 0.1, 0.1, 0.1),
    ]
    lost = marks(3, T0 - 30.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    per_agent = [(phases.agent_events(x, 2027), phases.script_marks(x)) for x in (a, lost)]
    split = phases.classic_breakdown(T0, per_agent, T0 + 2.5)
    assert split is not None
    assert split["detect"] == pytest.approx(0.1, abs=2e-3)
    assert split["rendezvous"] == pytest.approx(1.4, abs=2e-3)
    assert split["worker_start"] == pytest.approx(0.1, abs=2e-3)
    assert split["first_step"] == pytest.approx(0.4, abs=2e-3)


def test_no_split_without_a_reaction_a_start_or_a_worker_s_marks() -> None:
    started = [glog(T0 + 0.1, "Stopping worker group"), glog(T0 + 0.3, "Starting worker group")]
    workers = marks(5, T0 + 0.4, 0.1, 0.1, 0.1, 0.1, 0.1)
    events = phases.agent_events(started, 2027)
    found = phases.script_marks(workers)
    assert phases.classic_breakdown(T0 + 5.0, [(events, found)], T0 + 6.0) is None
    assert phases.classic_breakdown(T0, [(events[:1], found)], T0 + 2.0) is None
    assert phases.classic_breakdown(T0, [(events, {})], T0 + 2.0) is None
    # a worker that had not reached its first batch by the step is not of that round
    assert phases.classic_breakdown(T0, [(events, found)], T0 + 0.8) is None


def test_every_rank_logs_its_steps_and_only_rank_0_s_count() -> None:
    lines = [
        "step=21 epoch=0 loss=6.9077 world=2 rank=1 pid=6 t=100.400",
        "step=21 epoch=0 loss=6.9077 world=2 rank=0 pid=5 t=100.410",
        "step=21 epoch=0 loss=6.9 world=2 rank=10 pid=8 t=100.420",
        "step=22 world=2 group_rank=1 pid=9 t=100.5",  # no rank= of its own
    ]
    assert parse_steps(lines) == [StepLine(21, 2, 5, 100.41), StepLine(22, 2, 9, 100.5)]
    assert parse_step_line(lines[0]) is None


def test_recovery_phases_of_a_job_running_the_classic_script(tmp_path: Path) -> None:
    now = float(int(time.time()))  # recovery_phases reads torch's dates in this year
    logs = {
        "agent0": [
            *marks(3, now - 20.0, 0.5, 0.5, 0.5, 0.5, 0.5),  # the job's first start
            glog(now + 0.2, "Stopping worker group"),
            glog(now + 0.5, "Starting worker group"),
            *marks(11, now + 0.6, 0.1, 0.2, 0.1, 0.1, 0.3),
            "step=41 epoch=0 loss=6.9 world=2 rank=0 pid=11 t=%.3f" % (now + 1.9),
        ],
        "agent1": [
            glog(now + 0.1, "Stopping worker group"),
            glog(now + 0.4, "Starting worker group"),
            *marks(12, now + 0.55, 0.15, 0.2, 0.1, 0.1, 0.3),
            "step=41 epoch=0 loss=6.9 world=2 rank=1 pid=12 t=%.3f" % (now + 1.9),
        ],
    }
    job = Job("elasticjob-run", tmp_path, "127.0.0.1:1", "2:2", [], "r", script=classic.SCRIPT)
    for name, lines in logs.items():
        log = tmp_path / f"{name}.log"
        log.write_text("\n".join(lines) + "\n")
        job.agents.append(Agent(name, cast(subprocess.Popen[bytes], None), log, classic.SCRIPT))
    (after,) = [s for s in job.steps() if s.t > now]
    assert after.pid == 11  # rank 1's line is not a step of the job's
    split = recovery_phases(job, now, after)
    assert split == pytest.approx(
        {
            "detect": 0.1,
            "rendezvous": 0.4,
            "worker_start": 0.1,
            "process_group": 0.1,
            "model": 0.2,
            "checkpoint": 0.1,
            "ddp": 0.1,
            "loader": 0.3,
            "first_step": 0.5,
        },
        abs=2e-3,
    )


def test_the_group_expands_and_each_job_keeps_its_checkpoint_in_its_directory() -> None:
    assert classic.expand(["worker-kill", "classic", "classic-node-kill"]) == [
        "worker-kill",
        "classic-worker-kill",
        "classic-node-kill",
        "classic-scale-up",
    ]
    args = classic.train_args(Path("/w/classic-worker-kill-elasticjob-run-0"))
    assert "--checkpoint-interval=20" in args and "--image-size=64" in args
    assert args[-1] == (
        "--checkpoint-file=/w/classic-worker-kill-elasticjob-run-0/classic-ckpt/checkpoint.pth.tar"
    )
    assert classic.SCRIPT.name == "classic_imagenet.py" and classic.SCRIPT.exists()


SPLIT = {
    "detect": 0.1,
    "rendezvous": 0.15,
    "worker_start": 0.05,
    "process_group": 0.1,
    "model": 0.2,
    "checkpoint": 0.15,
    "ddp": 0.05,
    "loader": 0.3,
    "first_step": 0.6,
}
COLD = {**SPLIT, "rendezvous": 2.0, "worker_start": 3.5, "ddp": 2.0}


def results() -> list[Result]:
    return [
        Result("elasticjob-run", "classic-worker-kill", 0, 1.7, 9, pause=1.9, phases=SPLIT),
        Result("torchrun-c10d", "classic-worker-kill", 0, 10.8, 9, pause=11.0, phases=COLD),
        Result("elasticjob-run", "classic-node-kill", 0, 3.4, 12, pause=3.6, phases=SPLIT),
        Result("torchrun-c10d", "classic-node-kill", 0, error="timed out", gave_up_after=150.0),
        Result("elasticjob-run", "classic-scale-up", 0, 7.0, 4, pause=2.5, step_time=0.4),
    ]


def test_the_figures_hold_ours_to_the_targets_beside_torchrun() -> None:
    launchers = ["elasticjob-run", "torchrun-c10d"]
    figs = {(f.scenario, f.metric): f for f in classic.figures(summarize(results()), launchers)}
    kill = figs[("classic-worker-kill", "SIGKILL a worker -> next step")]
    assert (kill.ours, kill.baseline, kill.target, kill.met) == ([1.7], [10.8], "<= 2 s", True)
    lost = figs[("classic-node-kill", "SIGKILL an agent (3->2) -> next step")]
    assert (lost.ours, lost.baseline, lost.met) == ([3.4], [], False)
    join = figs[("classic-scale-up", "training paused (last step -> next step)")]
    assert (join.ours, join.target, join.met) == ([2.5], "<= 3 s", True)
    assert "0.40 s (ours)" in join.note
    joined = figs[("classic-scale-up", "agent joins (2->3) -> step at 3")]
    assert joined.target is None and joined.met is None


def test_the_tables_show_the_classic_rows_and_whose_seconds_they_are() -> None:
    launchers = ["elasticjob-run", "torchrun-c10d"]
    summary = summarize(results())
    text = table(summary, launchers)
    assert "classic_imagenet: SIGKILL a worker -> next step" in text
    assert "detect/rendezvous/worker/pg/model/ckpt/ddp/loader/step" in text
    assert "0.1/0.1/0.1/0.1/0.2/0.1/0.1/0.3/0.6" in text  # medians, one decimal
    assert "> 150 s (no step, n=1)" in text
    split = classic.breakdown_table(summary, launchers)
    assert "worker start" in split and "launcher" in split and "script" in split
    # ours 0.1 + 0.15 + 0.05 of the launcher's; torchrun's cold start 0.1 + 2.0 + 3.5
    assert classic.owned(SPLIT) == {"launcher": 0.3, "script": 1.4}
    assert classic.owned(COLD) == {"launcher": 5.6, "script": 3.35}
    assert "| 0.30" in split and "| 5.60" in split
    assert classic.breakdown_table({}, launchers) == ""


def test_steps_a_group_trained_after_the_fault_and_trains_again_count_as_redone() -> None:
    # a scale-up: the old group (rank 0's pid 5) trains steps 90-92 while the newcomer
    # starts; the group of 3 resumes from the step-80 checkpoint
    steps = [StepLine(n, 2, 5, 100.0 + 0.3 * (n - 89)) for n in range(89, 93)]
    after = StepLine(81, 3, 9, 103.0)
    assert steps_redone([*steps, after], {5}, 100.05, after) == 12
    # a worker kill: only what was done by the fault, or by an old worker in flight
    kill = [StepLine(41, 2, 5, 10.0), StepLine(42, 2, 5, 10.2), StepLine(41, 2, 9, 11.0)]
    assert steps_redone(kill, {5}, 10.1, kill[2]) == 2
    assert steps_redone(kill, set(), 10.1, kill[2]) == 1  # step 42 was not an old pid's
    # survivors that regroup in place go on from their own last step
    in_place = [StepLine(41, 2, 5, 10.0), StepLine(42, 2, 5, 10.5)]
    assert steps_redone(in_place, {5}, 10.1, in_place[1]) == 0
    assert steps_redone([], {5}, 10.1, after) is None
