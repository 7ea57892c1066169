"""What the pod watch knows that a round's listing cannot: a worker pod's last state.

A round lists the job's pods from the API server; the watch that delivers their events may
run behind that listing. Two things follow.

* A drain's eviction, a preemption or a kubelet termination marks the pod
  ``DisruptionTarget`` before it goes, and rule "Disrupted worker" (workers.py) replaces
  such a worker without charging ``backoffLimit``. A pod whose worker exits at once on
  SIGTERM can be gone before any round listed it with that mark; its DELETED event still
  carries its last state, so the pod handler notes it here as *taken*.
* Until that DELETED event has come, a pod the listing lacks is *departing*: its last state
  is unread, and deciding it now would call a drained worker failed (a ``backoffLimit: 0``
  job failed so, once in a full CI run). The round waits for the event instead, which
  marks the job due again. A watch that reconnected across the deletion never sends it,
  so a pod departs for at most ``DEPARTING_LIMIT_S`` and then counts as vanished.

Both are read in one step under one lock (:meth:`PodWatch.settle`): an event handled
between two reads would otherwise be lost to the round or read twice.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from elasticjob_operator.observe import disruption_of, worker_labels

# longer than any watch lag seen (milliseconds), shorter than a resync (which ends the wait)
DEPARTING_LIMIT_S: Final = 10.0

JobKey = tuple[str, str]  # (namespace, job)


def taken_index(body: Mapping[str, Any]) -> tuple[int, int] | None:
    """(index, incarnation) of a deleted worker pod the cluster took, else None."""
    return worker_labels(body) if disruption_of(dict(body)) else None


@dataclass(frozen=True)
class WatchNews:
    """What one round of a job takes from the watch."""

    # (index, incarnation) of workers the cluster took, seen only as DELETED
    taken: frozenset[tuple[int, int]] = frozenset()
    # indexes whose pod the listing lacks and whose DELETED event has not come yet
    departing: frozenset[int] = frozenset()


@dataclass
class _Job:
    alive: dict[str, int] = field(default_factory=dict)  # pod name -> index, not yet DELETED
    missing_since: dict[str, float] = field(default_factory=dict)  # alive, but not listed
    taken: set[tuple[int, int]] = field(default_factory=set)


class PodWatch:
    """Per job: the worker pods the watch holds alive, and the taken ones noted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[JobKey, _Job] = {}

    def saw(self, key: JobKey, name: str, index: int) -> None:
        """An ADDED, MODIFIED or listed pod: alive until its DELETED event."""
        with self._lock:
            self._jobs.setdefault(key, _Job()).alive[name] = index

    def deleted(self, key: JobKey, name: str, taken: tuple[int, int] | None) -> None:
        """A DELETED event: the pod is gone; ``taken``: the cluster took it."""
        with self._lock:
            job = self._jobs.setdefault(key, _Job())
            job.alive.pop(name, None)
            job.missing_since.pop(name, None)
            if taken is not None:
                job.taken.add(taken)
            if not job.alive and not job.taken:
                del self._jobs[key]

    def settle(self, key: JobKey, listed: frozenset[str], now: float) -> WatchNews:
        """The round's news, given the pod names it listed (``now``: a monotonic clock).
        The taken notes are handed over once; a departing pod stays departing until its
        DELETED event comes or ``DEPARTING_LIMIT_S`` has passed since a round first missed
        it."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return WatchNews()
            departing: set[int] = set()
            for name, index in list(job.alive.items()):
                if name in listed:
                    job.missing_since.pop(name, None)
                    continue
                since = job.missing_since.setdefault(name, now)
                if now - since < DEPARTING_LIMIT_S:
                    departing.add(index)
                else:  # its DELETED event was lost: it vanished
                    del job.alive[name], job.missing_since[name]
            news = WatchNews(frozenset(job.taken), frozenset(departing))
            job.taken.clear()
            if not job.alive:
                del self._jobs[key]
            return news
