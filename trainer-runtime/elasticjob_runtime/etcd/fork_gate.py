"""A fork in a training process waits while its progress publisher is inside a gRPC call.

A training script forks: a plain ``DataLoader`` forks its workers at every epoch. When a
thread of the same process is inside a gRPC call at that moment, gRPC skips its fork
handlers ("Other threads are currently calling into gRPC") and the child can abort:
``Check failed: next_worker->state == KICKED`` in gRPC's poller, which torch reports as
"DataLoader worker exited unexpectedly", or hangs. Measured by
``python -m bench.fork_beside_publisher`` (two-worker loaders back to back, 45-60 s a
run): with a new reporter opening its connection and granting its lease at each fork,
2 of 66 and 5 of 125 loaders failed; with this gate, none of 461 and 609. Beside a
reporter whose connection was open and publishing, none of 985 failed even without it.

So the publisher makes each pass's calls (a lease grant or refresh, a put, the ledger's)
only while it holds :data:`CALLS`, and a fork first takes it too: the fork waits for the
calls in flight, at most :data:`FORK_WAIT_S`, then goes ahead, as it would have. Each call
times out within :data:`CALL_TIMEOUT_S`, and a failed call ends the pass, so only a pass
of several slow calls that all answer outlasts the wait.
"""

from __future__ import annotations

import os
import threading

# The longest one publisher request may take (progress.py gives its client this timeout,
# or a third of its lease's TTL if that is shorter).
CALL_TIMEOUT_S = 5.0
# The longest a fork waits for the publisher: past a request that timed out.
FORK_WAIT_S = CALL_TIMEOUT_S + 1.0


class ForkGate:
    """One lock for the publisher's calls and the process's forks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forking = threading.local()

    def __enter__(self) -> ForkGate:
        self._lock.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self._lock.release()

    def before_fork(self) -> None:
        self._forking.held = self._lock.acquire(timeout=FORK_WAIT_S)

    def after_fork_in_parent(self) -> None:
        if getattr(self._forking, "held", False):
            self._forking.held = False
            self._lock.release()

    def after_fork_in_child(self) -> None:
        """The child has one thread, none of which is in a call: a fresh lock."""
        self._lock = threading.Lock()
        self._forking = threading.local()


CALLS = ForkGate()

os.register_at_fork(
    before=CALLS.before_fork,
    after_in_parent=CALLS.after_fork_in_parent,
    after_in_child=CALLS.after_fork_in_child,
)
