"""A job's ``status.goodput`` checked against clocks that are not the ledger's: the test's
own (when it applied the job) and the workers' step lines (``t=`` of each step, rank 0).

The job's wall time starts at its creation, which the test's clock brackets (just before
and just after `kubectl apply`; the API server keeps it to the second);
a recovery's pause is the gap in the step lines around it less one typical step, within
0.2 s or 10 % (docs/goodput.md).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from training_logs import Step

BUCKETS = ("training", "waiting", "startup", "lost", "checkpoint")
NOT_RECOVERIES = ("start", "suspended")


def booked(goodput: dict[str, Any]) -> float:
    """The sum of the buckets."""
    return sum(goodput[f"{b}Seconds"] for b in BUCKETS) + sum(goodput["pausedSeconds"].values())


def assert_buckets_add_up(goodput: dict[str, Any]) -> None:
    wall = goodput["wallSeconds"]
    assert abs(booked(goodput) - wall) <= 0.01 * wall, goodput


def assert_wall_agrees(goodput: dict[str, Any], applied: tuple[float, float]) -> None:
    """The buckets add up to the time from the job's creation to the ledger's last entry
    (``throughTime``), the creation as the test's clock brackets it: ``applied``, its
    readings just before and just after `kubectl apply`. The API server keeps the
    creation to the second (truncated): the ledger may start up to a second earlier."""
    through = datetime.fromisoformat(goodput["throughTime"]).timestamp()
    before, after = applied
    shortest, longest = through - after, through - before + 1.0
    slack = 0.01 * (through - before)
    assert shortest - slack <= booked(goodput) <= longest + slack, (applied, goodput)
    print(
        f"goodput: booked {booked(goodput):.2f} s, the creation's bracket "
        f"{shortest:.2f}-{longest:.2f} s"
    )


def typical_gap(steps: Sequence[Step]) -> float:
    return statistics.median(
        b.t - a.t for a, b in itertools.pairwise(steps) if b.step == a.step + 1
    )


def measured_pause(steps: Sequence[Step], mark: dict[str, Any], typical: float) -> float:
    """The gap around a timeline mark in the step lines, less a typical step: from the
    line of the step before it to the first line of the step after it that follows.

    Only rank 0 logs its steps, and a kill may land on it between committing the step
    before the mark and printing it: then that step's line is the one before it plus a
    typical step."""
    before = [s.t for s in steps if s.step == mark["fromStep"]]
    if not before:
        unprinted = [s.t + typical for s in steps if s.step == mark["fromStep"] - 1]
        assert unprinted, f"no step line of step {mark['fromStep']} or the one before it"
        before = unprinted
    t0 = before[-1]
    after = next((s.t for s in steps if s.step == mark["step"] and s.t > t0), None)
    assert after is not None, f"no line of step {mark['step']} after step {mark['fromStep']}"
    return after - t0 - typical


def assert_goodput_agrees(
    goodput: dict[str, Any], applied: tuple[float, float], steps: Sequence[Step]
) -> list[str]:
    """All of the above; the recoveries' causes, in order."""
    assert_buckets_add_up(goodput)
    assert_wall_agrees(goodput, applied)
    return assert_pauses_agree(goodput, steps)


def assert_pauses_agree(goodput: dict[str, Any], steps: Sequence[Step]) -> list[str]:
    """Every recovery on the timeline against the step lines; returns the causes, in order.
    A group that restarted may have taken on a ledger up to a second old (goodput.md)."""
    typical = typical_gap(steps)
    causes = []
    for mark in goodput["timeline"]:
        if mark["cause"] in NOT_RECOVERIES:
            continue
        causes.append(mark["cause"])
        measured = measured_pause(steps, mark, typical)
        slack = 1.2 if mark["cause"] == "restart" else 0.2
        pause = mark["pauseSeconds"]
        assert abs(pause - measured) <= max(slack, 0.1 * measured), (mark, measured, goodput)
        print(f"goodput: {mark['cause']} pause {pause:.3f} s, step lines {measured:.3f} s")
    assert sum(goodput["recoveries"].values()) == len(causes), goodput
    return causes
