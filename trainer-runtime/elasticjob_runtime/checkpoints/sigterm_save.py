"""SIGTERM: save the last completed step, then exit 143.

Kubernetes ends a pod with SIGTERM and, a grace period later, SIGKILL; torch's agent does
the same to its workers (30 s). A worker told to stop saves the step it last completed
(:meth:`~elasticjob_runtime.checkpoints.manager.CheckpointManager.mark_step` says which) on one of
three paths, whichever comes first, exactly once:

* at the **next step boundary** (``mark_step``): model, optimizer and sampler agree there;
* from a **watchdog** after ``grace_s``, at once when the agent says the group lost a
  peer (:func:`~elasticjob_runtime.launch.channel.group_broken`): a worker whose peer vanished
  sits in a collective that will not finish, so there may be no boundary to wait for;
* **at exit**, for a step that failed instead (a peer that got the same SIGTERM left the
  collective and the script's exception ends the process).

The last two save the live state while the training thread is somewhere inside a step,
and that state is the last completed step's only until the step's first optimizer
update. It is not safe to assume the update cannot come: a frozen peer the agent wakes
to save (SIGCONT) completes the collective its peers were blocked in, and their training
threads go on into ``optimizer.step`` while the watchdog serialises: a checkpoint
labelled step N holding step N+1's parameters, or a mix. So an :class:`UpdateGuard`,
told by a step pre-hook on each optimizer (``Run`` registers them;
:meth:`~elasticjob_runtime.checkpoints.manager.CheckpointManager.guard_updates` does it for any
script), decides (:func:`off_boundary_action`): before the step's first update, hold off
further updates and save step N; after one, wait for the boundary (which saves N+1) at
most ``grace_s`` in all, else exit without a save: the older checkpoint and the peers'
memory stand, which a restart resumes from correctly. Without registered hooks no update
is ever seen, and the paths save at once as they always did.

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
from enum import Enum
from types import FrameType
from typing import Any

from elasticjob_runtime.launch.channel import group_broken

log = logging.getLogger(__name__)

EXIT_CODE = 128 + int(signal.SIGTERM)


class Action(Enum):
    """What a save away from the step boundary does."""

    SAVE_NOW = "save the last completed step now"
    WAIT_FOR_BOUNDARY = "wait for the step boundary"
    LEAVE = "exit without a save"


def off_boundary_action(update_in_step: bool, boundary_wait_s: float) -> Action:
    """The rule for the watchdog and at-exit saves. Before the step's first optimizer
    update the live state is the last completed step's: save it. After one it is past
    that step (or still changing), and only the boundary can save it, as the next step:
    wait for it while ``boundary_wait_s`` allows, else leave with no save, since a
    checkpoint naming the wrong step would be restored as if it were right."""
    if not update_in_step:
        return Action.SAVE_NOW
    return Action.WAIT_FOR_BOUNDARY if boundary_wait_s > 0 else Action.LEAVE


class UpdateGuard:
    """Whether an optimizer update began since the last step boundary, shared by the
    optimizers' step pre-hooks (:meth:`before_update`) and the SIGTERM paths (:meth:`claim`).

    A flag set under a lock rather than a lock held from pre- to post-hook: the state is
    past the step from the update's start until the boundary, not only during it, and an
    update that raises would never release a held lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._updated = False  # an update began since the last boundary
        self._held = False  # a save of the last step holds the state: no update may begin

    def before_update(self, *_: Any) -> None:
        """An optimizer's step pre-hook. While a save holds the state it waits for ever:
        that save ends the process (``os._exit``)."""
        with self._cond:
            while self._held:
                self._cond.wait()
            self._updated = True

    def boundary(self) -> None:
        """A step boundary: the state is the marked step's again."""
        with self._cond:
            self._updated = False

    def claim(self, boundary_wait_s: float) -> Action:
        """:func:`off_boundary_action` now; ``SAVE_NOW`` also holds off every further
        update, atomically with the decision, so the state stays the saved step's."""
        with self._cond:
            action = off_boundary_action(self._updated, boundary_wait_s)
            if action is Action.SAVE_NOW:
                self._held = True
            return action


class SigtermSave:
    """The SIGTERM paths above; ``save_last()`` saves the last completed step, and
    ``last_step()`` names it for the log. Optimizer step pre-hooks go to ``guard``."""

    def __init__(self, save_last: Callable[[], None], last_step: Callable[[], int | None]) -> None:
        self._save_last = save_last
        self._last_step = last_step
        self._requested = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._old_handler: Any = None
        self._wakeup_w: int | None = None  # write end of the signal wakeup pipe we own
        self._grace_s = 0.0
        self.guard = UpdateGuard()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def at_step_boundary(self, stop_here: bool = True) -> None:
        """A step is complete (and marked): after SIGTERM, save it and exit here, unless
        not ``stop_here`` (the grace watchdog still bounds the wait)."""
        self.guard.boundary()
        if self._requested.is_set() and stop_here:
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
            action = self.guard.claim(0.0)
            if action is Action.LEAVE:
                log.warning(self._past_step_message())
            self.save(write=action is Action.SAVE_NOW)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._requested.is_set():
            return
        self._requested.set()
        broken = group_broken()
        if broken:
            log.warning(
                "SIGTERM: the group lost a peer, so the step in flight may never finish; "
                "saving the last completed step %s now, unless its successor's update began",
                self._last_step(),
            )
        else:
            log.warning(
                "SIGTERM: saving at the next step boundary (last completed step %s; "
                "watchdog after %.0f s)",
                self._last_step(),
                self._grace_s,
            )
        threading.Thread(
            target=self._watchdog, args=(broken,), name="checkpoint-sigterm", daemon=True
        ).start()

    def _watchdog(self, broken: bool) -> None:
        """Wait the grace for a boundary (not when the group broke); then save from here,
        unless an update ran in the step: then what is left of the grace (all of it when
        the group broke, none otherwise) goes to the boundary, which saves the next step."""
        if not broken and self._done.wait(self._grace_s):
            return
        left = self._grace_s if broken else 0.0
        action = self.guard.claim(left)
        if action is Action.WAIT_FOR_BOUNDARY:
            log.warning(
                "SIGTERM: step %s's optimizer update has begun, so the state is past step %s; "
                "saving at the step boundary instead (waiting at most %.0f s)",
                self._next_step(),
                self._last_step(),
                left,
            )
            if self._done.wait(left):
                return
            action = self.guard.claim(0.0)  # the boundary may have come after all
        try:
            if action is Action.LEAVE:
                log.warning(self._past_step_message())
            elif not broken:
                log.warning(
                    "SIGTERM: no step boundary within %.0f s, saving from the watchdog",
                    self._grace_s,
                )
            self.save(write=action is Action.SAVE_NOW)
        finally:
            logging.shutdown()
            os._exit(EXIT_CODE)

    def _next_step(self) -> str:
        last = self._last_step()
        return "the next" if last is None else str(last + 1)

    def _past_step_message(self) -> str:
        return (
            f"SIGTERM: exiting without a save: step {self._next_step()}'s optimizer update "
            "began but the step did not complete, so the state is no step's; the last "
            "checkpoint and the peers' memory stand"
        )

    def save(self, write: bool = True) -> None:
        """Save once (not ``write``: settle that there is no save), whichever path gets
        here first; the others wait for it."""
        if not self._lock.acquire(blocking=False):
            self._done.wait()  # the other path is saving; wait for it
            return
        try:
            if write and not self._done.is_set():
                self._save_last()
        finally:
            self._done.set()
            self._lock.release()
