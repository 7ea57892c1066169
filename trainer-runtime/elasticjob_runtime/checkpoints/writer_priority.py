"""A checkpoint writer thread yields the CPU to the training.

An asynchronous save's thread serialises, hashes, writes and fsyncs the state while the
training goes on. On a node whose cores the training fills (the bench's 2 cores, a
CPU-only job) that thread's CPU, about 0.15 s per save of the realistic example's 53 MB,
was taken from the training ranks at the scheduler's even share.

Linux schedules each thread as a task with a nice value of its own, so the writer thread
lowers its own to :data:`WRITER_NICE`: it then runs in the cores' idle time (a rank that
waits in its all-reduce, a loader between batches). It cannot hold the training up by
holding the GIL while it waits for a core: a training thread that waits for the GIL
sleeps, and leaves its core to the writer. Where the cores have no idle time before the
next interval's save, that ``save()`` waits for the writer as it always did, and the
wait is the idle time the writer needs. In the realistic goodput run (2 ranks on 2 busy
cores, a save every 20 steps) the saves cost 1.5-2.3 s of the 300 s window at nice 19
against 3.6-4.9 s before (bench/README.md).

Nothing else changes: the training thread and every other thread keep their priority,
and where the call is refused (not Linux, or a sandbox that forbids it) the save runs
as before.
"""

from __future__ import annotations

import os
import threading

# The lowest priority a thread can take without privileges (19 is the bottom of nice's range).
WRITER_NICE = 19


def yield_cpu_to_training() -> bool:
    """Lower the calling thread's priority to :data:`WRITER_NICE`; whether it took."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (OSError, AttributeError):
        return False
    return True


def thread_nice() -> int:
    """The calling thread's nice value (for tests and logs)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
