"""``elasticjob_examples.train_regression`` whose training thread, after SIGUSR1, blocks
for ever at its next step boundary: a deadlock (a data loader that never answers), not a
stopped process. The kernel still runs it, its other threads answer, and nothing tells it
from a worker in a long step.

It blocks after the step is marked complete, where model, optimizer and sampler agree,
so SIGTERM (the checkpoint's signal thread) saves that step and ends the process.
"""

from __future__ import annotations

import runpy
import signal
import threading
from types import FrameType
from typing import Any

from elasticjob_runtime.checkpoints.manager import CheckpointManager

SIGNALLED = threading.Event()
_mark_step = CheckpointManager.mark_step


def mark_step_then_block(self: CheckpointManager, step: int, **kw: Any) -> None:
    _mark_step(self, step, **kw)
    if SIGNALLED.is_set() and threading.current_thread() is threading.main_thread():
        threading.Event().wait()


def on_sigusr1(signum: int, frame: FrameType | None) -> None:
    SIGNALLED.set()


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, on_sigusr1)
    CheckpointManager.mark_step = mark_step_then_block  # type: ignore[method-assign]
    runpy.run_module("elasticjob_examples.train_regression", run_name="__main__", alter_sys=True)
