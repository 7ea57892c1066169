"""The goodput ledger's rules: every second in exactly one bucket, pauses by cause."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_runtime.goodput import ledger as gl
from elasticjob_runtime.goodput.ledger import Cause


def steps(
    ledger: gl.Ledger, first: int, count: int, every: float, at: float
) -> tuple[gl.Ledger, float]:
    for step in range(first, first + count):
        at += every
        ledger = gl.committed(ledger, step, at)
    return ledger, at


def test_the_time_to_the_first_commit_is_startup_and_steps_after_it_train() -> None:
    ledger = gl.opened(100.0)
    ledger = gl.committed(ledger, 1, 112.0)
    ledger, _ = steps(ledger, 2, 10, 0.5, 112.0)
    assert ledger.startup == pytest.approx(12.0)
    assert ledger.training == pytest.approx(5.0)
    assert ledger.wall == pytest.approx(17.0) == pytest.approx(ledger.accounted)
    assert ledger.goodput == pytest.approx(5.0 / 17.0)
    assert ledger.typical_step == pytest.approx(0.5)


def test_a_crash_books_the_dropped_step_as_lost_and_the_rest_less_one_step_as_its_pause() -> None:
    ledger, at = steps(gl.committed(gl.opened(0.0), 1, 10.0), 2, 20, 0.5, 10.0)
    trained = ledger.training
    ledger = gl.interrupted(ledger, Cause.FAILURE, at + 0.3)  # 0.3 s into a step
    ledger = gl.paused(ledger, at + 0.5)  # the regroup is done
    ledger = gl.committed(ledger, 22, at + 1.4)  # the first step after: 0.5 trained
    assert ledger.lost == pytest.approx(0.3)
    assert ledger.paused == {"failure": pytest.approx(0.6)}
    assert ledger.recoveries == {"failure": 1}
    assert ledger.training == pytest.approx(trained + 0.5)
    # last step -> next step was 1.4 s, of which one step trained: the pause a user sees
    assert ledger.longest_pause == pytest.approx(0.9)
    assert ledger.recovering is None
    assert ledger.accounted == pytest.approx(ledger.wall)


def test_a_regroup_tried_again_is_one_recovery_under_its_first_cause() -> None:
    ledger, at = steps(gl.committed(gl.opened(0.0), 1, 1.0), 2, 5, 0.5, 1.0)
    ledger = gl.interrupted(ledger, Cause.JOIN, at + 0.1)
    ledger = gl.interrupted(ledger, Cause.FAILURE, at + 0.7)
    ledger = gl.committed(ledger, 7, at + 1.5)
    assert ledger.recoveries == {"join": 1}
    assert set(ledger.paused) == {"join"}
    assert ledger.accounted == pytest.approx(ledger.wall)


def test_after_a_restart_the_gap_is_its_pause_and_the_steps_done_again_are_lost() -> None:
    ledger, at = steps(gl.committed(gl.opened(0.0), 1, 2.0), 2, 29, 0.5, 2.0)  # step 30
    published = gl.decode(json.loads(json.dumps(gl.encode(ledger))))  # through etcd
    restart = gl.restarted(published, Cause.RESTART)
    # the new group resumes from the checkpoint of step 20: 21..30 are done again
    ledger = gl.committed(restart, 21, at + 8.0 + 0.5)
    assert ledger.paused == {"restart": pytest.approx(8.0)}
    assert ledger.recovering is None
    ledger, at2 = steps(ledger, 22, 9, 0.5, at + 8.5)
    assert ledger.lost == pytest.approx(5.0)  # ten steps of 0.5 s, the first one included
    ledger = gl.committed(ledger, 31, at2 + 0.5)
    assert ledger.training == pytest.approx(published.training + 0.5)
    assert ledger.accounted == pytest.approx(ledger.wall)


def test_a_clock_behind_the_publishers_books_nothing_twice() -> None:
    ledger = gl.committed(gl.committed(gl.opened(0.0), 1, 5.0), 2, 6.0)
    restart = gl.committed(gl.restarted(ledger, Cause.RESTART), 3, 5.5)  # this clock: 0.5 s behind
    assert restart.through == 6.0 and restart.accounted == pytest.approx(restart.wall)
    assert restart.last is not None and restart.last.pause == 0.0  # never negative
    assert gl.decode(gl.encode(restart)) == restart


def test_a_save_after_a_commit_is_checkpoint_time_not_training() -> None:
    ledger = gl.committed(gl.committed(gl.opened(0.0), 1, 1.0), 2, 1.5)
    ledger = gl.committed(gl.saved(ledger, 3.0), 3, 3.5)
    assert ledger.checkpoint == pytest.approx(1.5)
    assert ledger.training == pytest.approx(1.0)


def test_a_fault_before_any_normal_step_is_all_pause() -> None:
    ledger = gl.interrupted(gl.committed(gl.opened(0.0), 1, 10.0), Cause.FAILURE, 10.2)
    ledger = gl.committed(ledger, 2, 12.0)  # no typical step yet: none of it is the step's
    assert ledger.training == 0.0
    assert ledger.paused == {"failure": pytest.approx(1.8)}
    assert ledger.last == gl.Recovered("failure", pytest.approx(2.0), 2, 12.0)


def test_a_run_that_ends_in_a_regroup_ends_its_recovery() -> None:
    ledger, at = steps(gl.committed(gl.opened(0.0), 1, 1.0), 2, 4, 0.5, 1.0)
    ledger = gl.finished(gl.interrupted(ledger, Cause.DEPARTURE, at + 0.1), at + 0.6)
    assert ledger.recovering is None and ledger.recoveries == {"departure": 1}
    assert ledger.longest_pause == pytest.approx(0.6)
    assert ledger.accounted == pytest.approx(ledger.wall)


def test_the_timeline_marks_the_start_and_each_recovery_with_its_steps_and_group() -> None:
    ledger = gl.formed(gl.opened(100.0), 2)
    ledger, at = steps(gl.committed(ledger, 1, 110.0), 2, 9, 0.5, 110.0)  # step 10
    ledger = gl.interrupted(ledger, Cause.JOIN, at + 0.1)
    ledger = gl.formed(gl.paused(ledger, at + 0.3), 4)
    ledger = gl.committed(ledger, 11, at + 0.8)
    assert ledger.marks == (
        gl.Mark("start", 100.0, 110.0, 10.0, 0, 1, 2),
        gl.Mark("join", at, at + 0.8, pytest.approx(0.3), 10, 11, 4),
    )
    back = gl.decode(json.loads(json.dumps(gl.encode(ledger))))
    assert gl.encode(back) == gl.encode(ledger) and back.world == 4


def test_the_timeline_keeps_the_start_and_the_newest_recoveries() -> None:
    ledger, at = gl.committed(gl.opened(0.0), 1, 1.0), 1.0
    for step in range(2, 2 + 2 * gl.MARKS_KEPT):
        at += 1.0
        ledger = gl.committed(gl.interrupted(ledger, Cause.FAILURE, at - 0.5), step, at)
    assert len(ledger.marks) == gl.MARKS_KEPT
    assert ledger.marks[0].cause == "start" and ledger.marks[-1].step == ledger.step
    assert [m.step for m in ledger.marks[1:]] == list(
        range(ledger.step - gl.MARKS_KEPT + 2, ledger.step + 1)
    )


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ("[]", "not an object"),
        ('{"opened": "x"}', "ledger.opened"),
        ('{"opened": 1, "through": -2}', "ledger.through"),
        (
            '{"opened": 1, "through": 2, "training": 0, "startup": 0, "lost": 0, "checkpoint": 0,'
            ' "paused": [], "step": 1, "longest_pause": 0}',
            "ledger.paused",
        ),
        ('{"marks": [["start", 1, 2]]}', "ledger.marks.0."),
        ('{"marks": [["start", 1, 2, 1, 0, -1, 2]]}', "ledger.marks.0..step: negative"),
    ],
)
def test_a_malformed_ledger_is_refused_naming_the_field(doc: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        gl.decode(json.loads(doc))


def test_a_cause_this_runtime_does_not_know_is_kept() -> None:
    ledger = gl.interrupted(
        gl.committed(gl.opened(0.0), 1, 1.0), "preempted-by-a-newer-runtime", 2.0
    )
    back = gl.decode(json.loads(json.dumps(gl.encode(gl.committed(ledger, 2, 3.0)))))
    assert back.recoveries == {"preempted-by-a-newer-runtime": 1}


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["commit", "redo", "fault", "pause", "restart", "save", "end"]),
        st.floats(min_value=0.0, max_value=5.0),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_every_second_falls_in_exactly_one_bucket(events: list[tuple[str, float]]) -> None:
    ledger, at, step, restarts = gl.opened(1000.0), 1000.0, 0, 0
    for kind, gap in events:
        at += gap
        if kind == "commit":
            step += 1
            ledger = gl.committed(ledger, step, at)
        elif kind == "redo":
            ledger = gl.committed(ledger, max(1, step - 3), at)
        elif kind == "save":
            ledger = gl.saved(ledger, at)
        elif kind == "end":
            ledger = gl.finished(ledger, at)
        elif kind == "fault":
            ledger = gl.interrupted(ledger, Cause.FAILURE, at)
        elif kind == "pause":
            ledger = gl.paused(ledger, at)
        else:
            ledger = gl.restarted(gl.decode(gl.encode(ledger)), Cause.RESTART)
            at -= gap * 2  # the new process's clock may be behind
            restarts += 1  # each trip through the stored form rounds to milliseconds
        assert ledger.accounted == pytest.approx(ledger.wall, abs=0.001 + 0.005 * restarts)
        assert min(ledger.training, ledger.lost, ledger.startup, ledger.checkpoint) >= 0
        assert all(v >= 0 for v in ledger.paused.values())
        assert ledger.longest_pause <= ledger.wall + 0.01
        assert len(ledger.marks) <= gl.MARKS_KEPT
        assert all(m.since <= m.at + 0.01 and m.pause >= 0 for m in ledger.marks)
