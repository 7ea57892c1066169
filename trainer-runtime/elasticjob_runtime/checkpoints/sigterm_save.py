"""SIGTERM: save the last completed step, then exit 143.

Kubernetes ends a pod with SIGTERM and, a grace period later, SIGKILL; torch's agent does
the same to its workers (30 s). A worker told to stop saves the step it last completed
(:meth:`~elasticjob_runtime.checkpoints.manager.CheckpointManager.mark_step` says which) on one of
three paths, whichever comes first, exactly once:

* at the **next step boundary** (``mark_step``): model, optimizer and sampler agree there;
* from a **watchdog** after ``grace_s``: a worker whose peer vanished sits in a
  collective that will not finish; the parameters still hold the last completed step
  (they change only in ``optimizer.step``, after the collectives). When the agent says
  the group lost a peer (:func:`~elasticjob_runtime.launch.channel.group_broken`) there is no
  boundary to wait for, and the watchdog saves at once;
* **at exit**, for a step that failed instead (a peer that got the same SIGTERM left the
  collective and the script's exception ends the process).

Python runs signal handlers between bytecodes of the main thread only, so a worker
blocked in C++ would not see SIGTERM until the SIGKILL; the C-level handler's wakeup fd
is read by a thread that starts the same path at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from elasticjob_runtime.launch.channel import group_broken

log = logging.getLogger(__name__)

EXIT_CODE = 128 + int(signal.SIGTERM)


class SigtermSave:
    """The SIGTERM paths above; ``save_last()`` saves the last completed step, and
    ``last_step()`` names it for the log."""

    def __init__(self, save_last: Callable[[], None], last_step: Callable[[], int | None]) -> None:
        self._save_last = save_last
        self._last_step = last_step
        self._requested = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._old_handler: Any = None
        self._wakeup_w: int | None = None  # write end of the signal wakeup pipe we own
        self._grace_s = 0.0

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def at_step_boundary(self) -> None:
        """After SIGTERM: save, and exit here."""
        if self._requested.is_set():
            self.save()
            raise SystemExit(EXIT_CODE)

    def install(self, grace_s: float) -> None:
        self._grace_s = grace_s
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._old_handler is None:
            self._old_handler = previous
            atexit.register(self._at_exit)
            self._watch_wakeup_fd()

    def uninstall(self) -> None:
        """Put back the previous handler and stop reading the wakeup fd."""
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None
        if self._wakeup_w is not None:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass  # not the main thread: keep the pipe, a reused fd must not get bytes
            else:
                os.close(self._wakeup_w)  # the watcher thread reads EOF and ends
                self._wakeup_w = None

    def _watch_wakeup_fd(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the plain handler is all there is
            os.close(r)
            os.close(w)
            return
        if previous != -1:  # someone else (an asyncio loop) owns the wakeup fd
            signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return
        self._wakeup_w = w

        def watch() -> None:
            with contextlib.suppress(OSError), os.fdopen(r, "rb", buffering=0) as pipe:
                while data := pipe.read(64):
                    if int(signal.SIGTERM) in data:
                        self._on_sigterm(int(signal.SIGTERM), None)

        threading.Thread(target=watch, name="checkpoint-signals", daemon=True).start()

    def _at_exit(self) -> None:
        if self._requested.is_set() and not self._done.is_set():
            self.save()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._requested.is_set():
            return
        self._requested.set()
        grace = 0.0 if group_broken() else self._grace_s
        if grace == 0.0:
            log.warning(
                "SIGTERM: the group lost a peer, so the step in flight cannot finish; "
                "saving the last completed step %s now",
                self._last_step(),
            )
        else:
            log.warning(
                "SIGTERM: saving at the next step boundary (last completed step %s; "
                "watchdog after %.0f s)",
                self._last_step(),
                grace,
            )
        threading.Thread(
            target=self._watchdog, args=(grace,), name="checkpoint-sigterm", daemon=True
        ).start()

    def _watchdog(self, grace: float) -> None:
        if self._done.wait(grace):
            return
        if grace > 0:
            log.warning("SIGTERM: no step boundary within %.0f s, saving from the watchdog", grace)
        try:
            self.save()
        finally:
            logging.shutdown()
            os._exit(EXIT_CODE)

    def save(self) -> None:
        """Save once, whichever path gets here first; the others wait for it."""
        if not self._lock.acquire(blocking=False):
            self._done.wait()  # the other path is saving; wait for it
            return
        try:
            if not self._done.is_set():
                self._save_last()
        finally:
            self._done.set()
            self._lock.release()
