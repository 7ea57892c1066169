"""Deleted jobs whose children are still to be deleted, handed over in batches.

Deleting a job's children takes the operator about seven API calls (a deletecollection
per kind by the job's uid label, the Services). Fifty jobs deleted at once made that 350
calls, queued on an API server busy with the pods' own deletion: 51 s before every pod
was even asked to go (bench/results/operator_load.md). A burst is one batch instead: the
uids of the jobs deleted within :data:`GATHER_SECONDS` of the first, per namespace, go to
one call per kind (``job-uid in (...)``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

# how long a batch waits for more deletions after its first: a `kubectl delete` of many
# jobs sends their DELETED events within a few milliseconds of each other
GATHER_SECONDS: Final = 0.3
# the most uids in one label selector (each 36 characters; the selector goes in a URL)
BATCH: Final = 50


def batches(pending: dict[str, list[str]], most: int = BATCH) -> list[tuple[str, list[str]]]:
    """The pending uids per namespace, in batches of at most ``most``, in order."""
    out = []
    for namespace, uids in pending.items():
        unique = list(dict.fromkeys(uids))
        out += [(namespace, unique[i : i + most]) for i in range(0, len(unique), most)]
    return out


class Deletions:
    """Collects deleted jobs' uids and calls ``delete(namespace, uids)`` for each batch,
    on a thread of its own (the kopf event loop only adds)."""

    def __init__(
        self, delete: Callable[[str, list[str]], None], gather: float = GATHER_SECONDS
    ) -> None:
        self._delete = delete
        self._gather = gather
        self._cond = threading.Condition()
        self._pending: dict[str, list[str]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="elasticjob-deletions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, namespace: str, uid: str) -> None:
        with self._cond:
            self._pending.setdefault(namespace, []).append(uid)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopped)
                if self._stopped and not self._pending:
                    return
            threading.Event().wait(self._gather)  # let the rest of a burst arrive
            with self._cond:
                pending, self._pending = self._pending, {}
            for namespace, uids in batches(pending):
                try:
                    self._delete(namespace, uids)
                except Exception as exc:  # the garbage collector removes them, only slower
                    log.warning(
                        "%s: deleting %d deleted jobs' children failed: %s",
                        namespace,
                        len(uids),
                        exc,
                    )
