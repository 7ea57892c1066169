"""The agent's hang watch over real channel files: a group that stops stepping is a hang
after the timeout (once it has done a step), and a round handed in place that a worker
does not take counts as silence. The clock rules themselves: test_hang*.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

from elasticjob_runtime.channel import AgentChannel, StepReporter
from elasticjob_runtime.hang_watch import STEP_READ_INTERVAL_S, HangWatch

TIMEOUT = 0.3


def wait_read_interval() -> None:
    time.sleep(STEP_READ_INTERVAL_S + 0.05)


def test_a_group_that_stops_stepping_hangs_after_the_timeout(tmp_path: Path) -> None:
    channel = AgentChannel(tmp_path)
    watch = HangWatch(channel, TIMEOUT, membership=None)
    pids = {0: os.getpid()}
    reporter = StepReporter(tmp_path, 0)
    watch.round_started(1, [0], in_place=False)
    wait_read_interval()
    assert watch.hang(pids) is None  # no step yet: start-up is never a hang
    reporter.report(5)
    wait_read_interval()
    assert watch.hang(pids) is None  # the first step starts the clock
    wait_read_interval()
    message = watch.hang(pids)
    assert message is not None and "after step 5" in message
    assert watch.hangs == 1
    reporter.close()


def test_a_round_handed_in_place_and_not_taken_is_silence(tmp_path: Path) -> None:
    channel = AgentChannel(tmp_path)
    watch = HangWatch(channel, TIMEOUT, membership=None)
    pids = {0: os.getpid()}
    watch.round_started(3, [0], in_place=True)  # rank 0 never says taken-0
    time.sleep(TIMEOUT + 0.05)
    refusal = watch.in_place_refusal(pids, generation=3)
    assert refusal is not None
    wait_read_interval()
    message = watch.hang(pids)
    assert message is not None and "never took its new round" in message


def test_without_a_timeout_nothing_is_a_hang(tmp_path: Path) -> None:
    watch = HangWatch(AgentChannel(tmp_path), None, membership=None)
    watch.round_started(1, [0], in_place=False)
    assert watch.hang({0: os.getpid()}) is None
