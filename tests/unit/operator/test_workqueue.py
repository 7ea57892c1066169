"""The work queue: each job once in the queue, one thread at a time per job, the last
round after the last mark, user changes first."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from elasticjob_operator.workqueue import Key, WorkQueue


class Recorder:
    """A process function that records its rounds and can be held inside one."""

    def __init__(self) -> None:
        self.rounds: list[tuple[Key, bool]] = []
        self.started: list[Key] = []
        self.running: dict[Key, int] = {}
        self.overlap = False
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, key: Key, read_progress: bool) -> None:
        with self.lock:
            self.started.append(key)
            self.running[key] = self.running.get(key, 0) + 1
            self.overlap |= self.running[key] > 1
        self.entered.set()
        self.gate.wait(10)
        with self.lock:
            self.rounds.append((key, read_progress))
            self.running[key] -= 1


def wait_until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def queue(recorder: Recorder) -> Iterator[WorkQueue]:
    q = WorkQueue(recorder, workers=4)
    q.start()
    yield q
    recorder.gate.set()
    q.stop()


A, B, C = ("ns", "a"), ("ns", "b"), ("ns", "c")


def test_marks_while_queued_collapse_into_one_round(recorder: Recorder) -> None:
    q = WorkQueue(recorder, workers=2)
    for _ in range(100):
        q.add(A)
    q.add(A, read_progress=True)
    q.add(A)  # read_progress sticks until the round runs
    q.start()
    try:
        wait_until(lambda: recorder.rounds)
        time.sleep(0.1)
        assert recorder.rounds == [(A, True)]
    finally:
        q.stop()


def test_a_mark_during_a_round_runs_one_more_round_after_it(
    queue: WorkQueue, recorder: Recorder
) -> None:
    recorder.gate.clear()
    queue.add(A)
    assert recorder.entered.wait(10)
    for _ in range(5):
        queue.add(A)  # while A's round runs: not a second thread on A
    time.sleep(0.1)
    assert recorder.running[A] == 1
    recorder.gate.set()
    wait_until(lambda: len(recorder.rounds) == 2)
    time.sleep(0.1)
    assert recorder.rounds == [(A, False), (A, False)]
    assert not recorder.overlap


def test_urgent_marks_jump_the_queue(recorder: Recorder) -> None:
    q = WorkQueue(recorder, workers=2)
    q.add(A)
    q.add(B)
    q.add(C, urgent=True)
    q.add(B, urgent=True)  # already queued: moved among the urgent ones
    recorder.gate.clear()
    q.start()
    try:
        wait_until(lambda: sum(recorder.running.values()) == 2)
        assert set(recorder.running) == {B, C}  # both threads took urgent jobs first
        recorder.gate.set()
        wait_until(lambda: len(recorder.rounds) == 3)
        assert recorder.started[-1] == A
    finally:
        recorder.gate.set()
        q.stop()


def test_an_urgent_job_is_served_while_every_other_thread_is_busy() -> None:
    hold = threading.Event()
    served: list[Key] = []

    def process(key: Key, _: bool) -> None:
        if key != A:
            hold.wait(10)  # other jobs' rounds, stuck on a slow API server
        served.append(key)

    q = WorkQueue(process, workers=3)
    q.start()
    try:
        for i in range(10):
            q.add(("ns", f"busy-{i}"))
        time.sleep(0.1)
        q.add(A, urgent=True)  # a kubectl scale
        wait_until(lambda: A in served)
        assert served == [A]  # before any of the busy ones finished
    finally:
        hold.set()
        q.stop()


def test_a_failing_round_does_not_stop_the_workers() -> None:
    done: list[Key] = []

    def process(key: Key, _: bool) -> None:
        if key == A:
            raise RuntimeError("the API server said no")
        done.append(key)

    q = WorkQueue(process, workers=2)
    q.start()
    try:
        q.add(A)
        q.add(B)
        wait_until(lambda: done == [B])
    finally:
        q.stop()


def test_many_jobs_many_marks_no_job_twice_at_once(queue: WorkQueue, recorder: Recorder) -> None:
    keys = [("ns", f"j{i}") for i in range(20)]
    for _ in range(50):
        for key in keys:
            queue.add(key)
    wait_until(lambda: queue.pending() == 0 and not any(recorder.running.values()))
    time.sleep(0.1)
    assert {k for k, _ in recorder.rounds} == set(keys)
    assert not recorder.overlap


def test_needs_a_worker_beside_the_urgent_one() -> None:
    with pytest.raises(ValueError, match="at least two workers"):
        WorkQueue(lambda key, progress: None, workers=1)
