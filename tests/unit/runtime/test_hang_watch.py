"""The agent's hang watch, on the steps the agent hands it: a group that stops stepping is a
hang after the timeout (once it has done a step), and a round handed in place that a
worker does not take counts as silence. It reads no step file itself: the agent reads them
once per monitor pass for every reader. The clock rules themselves: test_hang*.py."""

from __future__ import annotations

import os
from pathlib import Path

from elasticjob_runtime.launch.channel import AgentChannel, StepReporter
from elasticjob_runtime.launch.hang_watch import HangWatch

TIMEOUT = 10.0
PIDS = {0: os.getpid()}


class NoStepReads(AgentChannel):
    """A channel whose step files the hang watch must not read."""

    def steps(self) -> dict[int, int]:
        raise AssertionError("the hang watch read the step files: the agent hands it steps")


def test_a_group_that_stops_stepping_hangs_after_the_timeout(tmp_path: Path) -> None:
    watch = HangWatch(NoStepReads(tmp_path), TIMEOUT, membership=None)
    watch.round_started(1, [0], in_place=False, steps={}, now=0.0)
    assert watch.hang(PIDS, {}, now=100.0) is None  # no step yet: start-up is never a hang
    assert watch.hang(PIDS, {0: 5}, now=101.0) is None  # the first step starts the clock
    assert watch.hang(PIDS, {0: 5}, now=101.0 + TIMEOUT - 0.5) is None
    message = watch.hang(PIDS, {0: 5}, now=101.0 + TIMEOUT)
    assert message is not None and "after step 5" in message
    assert watch.hangs == 1


def test_the_watch_judges_the_steps_it_is_given_not_the_files(tmp_path: Path) -> None:
    # The files say the group keeps stepping; the steps handed over say it stopped. A
    # watch that read the files again would see progress and call no hang.
    reporter = StepReporter(tmp_path, 0)
    watch = HangWatch(AgentChannel(tmp_path), TIMEOUT, membership=None)
    watch.round_started(1, [0], in_place=False, steps={}, now=0.0)
    assert watch.hang(PIDS, {0: 3}, now=1.0) is None
    assert watch.clock.last == 3  # the last step it was given, kept between calls
    for at in (2.0, 6.0, 1.0 + TIMEOUT):
        reporter.report(int(at) + 3)
        verdict = watch.hang(PIDS, {0: 3}, now=at)
    reporter.close()
    assert verdict is not None and "after step 3" in verdict


def test_progress_in_the_steps_given_keeps_the_clock_from_running_out(tmp_path: Path) -> None:
    watch = HangWatch(NoStepReads(tmp_path), TIMEOUT, membership=None)
    watch.round_started(1, [0, 1], in_place=False, steps={}, now=0.0)
    for i in range(5):
        # the group step is the lowest rank's: rank 1 keeps it moving
        assert watch.hang(PIDS, {0: 100, 1: i}, now=i * (TIMEOUT - 1)) is None
    message = watch.hang(PIDS, {0: 100, 1: 4}, now=4 * (TIMEOUT - 1) + TIMEOUT)
    assert message is not None and "after step 4" in message


def test_a_round_handed_in_place_and_not_taken_is_silence(tmp_path: Path) -> None:
    watch = HangWatch(NoStepReads(tmp_path), TIMEOUT, membership=None)
    # rank 0 had reported step 7 before; it never says taken-3 nor steps again
    watch.round_started(3, [0], in_place=True, steps={0: 7}, now=0.0)
    refusal = watch.in_place_refusal(PIDS, generation=3, steps={0: 7}, now=TIMEOUT / 2)
    assert refusal is not None
    message = watch.hang(PIDS, {0: 7}, now=TIMEOUT)
    assert message is not None and "never took its new round" in message


def test_without_a_timeout_nothing_is_a_hang(tmp_path: Path) -> None:
    watch = HangWatch(NoStepReads(tmp_path), None, membership=None)
    assert not watch.watching  # the agent reads no steps for it
    watch.round_started(1, [0], in_place=False, steps={}, now=0.0)
    assert watch.hang(PIDS, {0: 1}, now=1.0) is None
    assert watch.hang(PIDS, {0: 1}, now=1000.0) is None
