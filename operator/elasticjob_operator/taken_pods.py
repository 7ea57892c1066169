"""Worker pods the cluster took whose last state only their DELETED event showed.

A drain's eviction, a preemption or a kubelet termination marks the pod
``DisruptionTarget`` before it goes, and the rule "Disrupted worker" (workers.py) replaces
such a worker without charging ``backoffLimit``. A pod whose worker exits at once on
SIGTERM can be gone before a reconcile round lists it with that mark: the round then saw
only a vanished pod, a failure, and a ``backoffLimit: 0`` job failed for a drain (the e2e
eviction test). The watch's DELETED event still carries the pod's last state, so the pod
event handler notes it here, and the next round of its job takes the note (once).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from elasticjob_operator import builders
from elasticjob_operator.observe import disruption_of


def taken_index(body: Mapping[str, Any]) -> tuple[int, int] | None:
    """(index, incarnation) of a deleted worker pod the cluster took, else None."""
    if not disruption_of(dict(body)):
        return None
    labels = (body.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels[builders.LABEL_INDEX]), int(labels.get(builders.LABEL_INCARNATION, "0"))
    except (KeyError, ValueError):
        return None


class TakenPods:
    """(namespace, job) -> the (index, incarnation) of its workers the cluster took."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[tuple[str, str], set[tuple[int, int]]] = {}

    def note(self, namespace: str, job: str, taken: tuple[int, int]) -> None:
        with self._lock:
            self._taken.setdefault((namespace, job), set()).add(taken)

    def take(self, namespace: str, job: str) -> frozenset[tuple[int, int]]:
        """What was noted for the job since the last call (a round reads it once)."""
        with self._lock:
            return frozenset(self._taken.pop((namespace, job), ()))
