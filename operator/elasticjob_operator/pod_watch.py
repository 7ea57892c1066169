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
* The watch may also run behind the listing the other way: a pod created, listed and evicted
  within a fraction of a second may not have had its ADDED event handled yet. So a round's
  listing marks its pods alive too (:meth:`PodWatch.settle`), or the drained worker of a
  ``backoffLimit: 0`` job would count as vanished and fail the job (seen once in CI, 0.4 s
  after the job started). A pod whose DELETED event came is remembered as *gone* for
  ``GONE_KEEP_S``, so a listing read just before that event does not make it alive again.

Pods are told apart by uid, not name: a replacement reuses its predecessor's name, and the
watch's handlers for the two may run in either order.

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
# far longer than a listing can be older than the round that reads it
GONE_KEEP_S: Final = 60.0

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
    alive: dict[str, int] = field(default_factory=dict)  # pod uid -> index, not yet DELETED
    missing_since: dict[str, float] = field(default_factory=dict)  # uid: alive, not listed
    taken: set[tuple[int, int]] = field(default_factory=set)


class PodWatch:
    """Per job: the worker pods held alive, and the taken ones noted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[JobKey, _Job] = {}
        self._gone: dict[str, float] = {}  # uid -> when its DELETED event came

    def saw(self, key: JobKey, uid: str, index: int) -> None:
        """An ADDED or MODIFIED pod: alive until its DELETED event."""
        with self._lock:
            if uid not in self._gone:
                self._jobs.setdefault(key, _Job()).alive[uid] = index

    def deleted(self, key: JobKey, uid: str, taken: tuple[int, int] | None, now: float) -> None:
        """A DELETED event (``now``: a monotonic clock): the pod is gone; ``taken``: the
        cluster took it."""
        with self._lock:
            self._forget_gone(now)
            self._gone.pop(uid, None)  # re-inserted last: the dict stays in time order
            self._gone[uid] = now
            job = self._jobs.setdefault(key, _Job())
            job.alive.pop(uid, None)
            job.missing_since.pop(uid, None)
            if taken is not None:
                job.taken.add(taken)
            if not job.alive and not job.taken:
                del self._jobs[key]

    def settle(self, key: JobKey, listed: Mapping[str, int], now: float) -> WatchNews:
        """The round's news, given the pods it listed (uid -> index; ``now``: a monotonic
        clock). Listed pods are alive from here on. The taken notes are handed over once; a
        departing pod stays departing until its DELETED event comes or
        ``DEPARTING_LIMIT_S`` has passed since a round first missed it."""
        with self._lock:
            self._forget_gone(now)
            fresh = {uid: i for uid, i in listed.items() if uid not in self._gone}
            if not fresh and key not in self._jobs:
                return WatchNews()
            job = self._jobs.setdefault(key, _Job())
            job.alive.update(fresh)
            departing: set[int] = set()
            for uid, index in list(job.alive.items()):
                if uid in listed:
                    job.missing_since.pop(uid, None)
                    continue
                since = job.missing_since.setdefault(uid, now)
                if now - since < DEPARTING_LIMIT_S:
                    departing.add(index)
                else:  # its DELETED event was lost: it vanished
                    del job.alive[uid], job.missing_since[uid]
            news = WatchNews(frozenset(job.taken), frozenset(departing))
            job.taken.clear()
            if not job.alive:
                del self._jobs[key]
            return news

    def forget(self, key: JobKey) -> None:
        """The job is deleted: what is held for it goes (a pod whose DELETED event the
        watch missed would be held for ever, no round of the job settling it again)."""
        with self._lock:
            self._jobs.pop(key, None)

    def _forget_gone(self, now: float) -> None:
        """Drop the gone pods no listing can still hold (called under the lock)."""
        for uid, when in list(self._gone.items()):
            if now - when < GONE_KEEP_S:
                break  # inserted in time order: the rest are younger
            del self._gone[uid]
