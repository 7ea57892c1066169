"""A thread's wait that other threads, and other processes' exits, can end early.

Both sides of the agent channel used to poll: the agent's monitor loop every 0.1 s
(torch's ``monitor_interval``), a worker's round watcher every 50 ms. Every recovery
waited out half of each, and the watcher's wake-ups cost a training process a GIL
hand-over twenty times a second. :class:`Wakeup` waits on descriptors instead: a pipe
of its own (:meth:`Wakeup.nudge`, from any thread), a process's pidfd (readable once
that process has exited: :func:`pidfd_of`, Linux 5.3+), a FIFO another process writes to
(the channel's bell, launch/channel.py). Callers keep a timeout as the floor they had,
so a system without pidfds or FIFOs only loses the early wake.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Sequence


class Wakeup:
    """Wait up to a timeout for a nudge or for one of some descriptors to be readable."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # not inherited by the processes we start
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()  # a nudge never writes to a number close() freed
        self._closed = False

    def nudge(self) -> None:
        """End the current (or next) wait now; safe from any thread, from a signal
        handler, and after close()."""
        # A signal handler runs in the main thread, maybe inside nudge() or close()
        # holding the lock: it must not wait for it. Held by a nudge, a wake is pending
        # anyway; by close(), there is nothing left to wake.
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            with contextlib.suppress(OSError):  # full: a wake is pending anyway
                os.write(self._write, b"!")
        finally:
            self._lock.release()

    def wait(self, fds: Sequence[int], timeout: float) -> list[int] | None:
        """The descriptors of ``fds`` that are readable, [] after a nudge, None once
        ``timeout`` s passed with neither (a signal does not end it: Python retries the
        poll, PEP 475)."""
        poller = select.poll()  # not select(): a training process's descriptors pass 1024
        for fd in (self._read, *fds):
            poller.register(fd, select.POLLIN)
        events = poller.poll(max(timeout, 0.0) * 1000)
        if not events:
            return None
        ready = [fd for fd, _ in events]
        if self._read in ready:
            drain(self._read)
        return [fd for fd in ready if fd != self._read]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in (self._read, self._write):
                with contextlib.suppress(OSError):
                    os.close(fd)


def drain(fd: int) -> None:
    """Read a non-blocking descriptor empty."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass


def pidfd_of(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits, or None (no such
    process, or no pidfds on this system)."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:  # ProcessLookupError; ENOSYS before Linux 5.3; EPERM under a seccomp filter
        return None
