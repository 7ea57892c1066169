"""The jobs due for a reconcile, and the few threads that reconcile them.

Events only mark a job due (:meth:`WorkQueue.add` never waits for the API server), so a
burst of pod events holds neither their bodies nor a thread each: the operator's memory
stays flat however many events queue up, and a job marked a hundred times meanwhile is
reconciled once. As in client-go's work queue, a job is queued at most once and handled
by one thread at a time; marked again while it is being handled, it goes back in when
that round ends, so the last round always follows the last event. A change of the job
itself (a user's ``kubectl scale``) is urgent: served before the pod echoes of other
jobs' creations, by a thread kept for urgent jobs alone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
Process = Callable[[Key, bool], None]  # (key, read_progress)


class WorkQueue:
    def __init__(self, process: Process, workers: int) -> None:
        if workers < 2:
            raise ValueError(f"a work queue needs at least two workers, not {workers}")
        self._process = process
        self._workers = workers
        self._urgent: deque[Key] = deque()  # a user's changes, served first
        self._ready: deque[Key] = deque()  # everything else, in order
        self._due: dict[Key, bool] = {}  # queued or re-marked -> read progress this round
        self._active: set[Key] = set()
        self._active_urgent: set[Key] = set()  # re-marked urgently while active
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def add(self, key: Key, read_progress: bool = False, urgent: bool = False) -> None:
        """Mark ``key`` due; ``read_progress`` sticks until its round runs."""
        with self._cond:
            if key in self._due:  # queued, or re-marked while active
                self._due[key] = self._due[key] or read_progress
                if urgent and key in self._ready:
                    self._ready.remove(key)  # O(n) in the queue's length, only when urgent
                    self._urgent.append(key)
                    self._cond.notify_all()
                elif urgent and key in self._active:
                    self._active_urgent.add(key)
                return
            self._due[key] = read_progress
            if key in self._active:  # queued again when its running round ends
                if urgent:
                    self._active_urgent.add(key)
                return
            (self._urgent if urgent else self._ready).append(key)
            self._cond.notify_all()

    def pending(self) -> int:
        """Jobs marked due and not yet picked up."""
        with self._cond:
            return len(self._urgent) + len(self._ready)

    def start(self) -> None:
        """Worker 0 serves only urgent jobs, so a user's change never waits for a thread
        that is busy with other jobs' pod events; the others serve urgent jobs first."""
        with self._cond:
            self._stopping = False
        for i in range(self._workers):
            t = threading.Thread(
                target=self._run, args=(i == 0,), name=f"elasticjob-reconcile-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        """Let the running rounds end; queued jobs are dropped (a restart lists them all)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def _next(self, urgent_only: bool) -> tuple[Key, bool] | None:
        with self._cond:
            while not self._stopping and not self._urgent and (urgent_only or not self._ready):
                self._cond.wait()
            if self._stopping:
                return None
            key = (self._urgent if self._urgent else self._ready).popleft()
            self._active.add(key)
            return key, self._due.pop(key)

    def _done(self, key: Key) -> None:
        with self._cond:
            self._active.discard(key)
            if key in self._due:  # marked again while it ran
                (self._urgent if key in self._active_urgent else self._ready).append(key)
                self._cond.notify_all()
            self._active_urgent.discard(key)

    def _run(self, urgent_only: bool) -> None:
        while (item := self._next(urgent_only)) is not None:
            key, read_progress = item
            try:
                self._process(key, read_progress)
            except Exception as exc:  # one job's failure must not stop the others
                log.warning("%s/%s: reconcile failed: %s", key[0], key[1], exc)
            finally:
                self._done(key)
