"""The regression example, with one real fault at a fixed step so runs can be compared.

On its first attempt (``TORCHELASTIC_RESTART_COUNT=0``) the worker started as global
rank ``CRASH_RANK`` (default 1) SIGKILLs itself right after completing step
``CRASH_AT_STEP``; the restarted group resumes from the last checkpoint. Same seed and
same fault, so a cold and a warm restart must train exactly the same model.

The rank it was started with, not the one it holds at the step: a survivor regrouped in
place may be renumbered to that rank (the node whose collective failed first opens the
next round and comes first in it), and it would crash at the same step a second time.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from elasticjob_examples import train_regression

from elasticjob_runtime.checkpoints.manager import CheckpointManager


def main() -> None:
    at = int(os.environ["CRASH_AT_STEP"])
    crashes = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get(
        "RANK"
    ) == os.environ.get("CRASH_RANK", "1")
    mark_step = CheckpointManager.mark_step

    def crash_after(self: CheckpointManager, step: int, **kw: Any) -> None:
        mark_step(self, step, **kw)
        if step == at and crashes:
            os.kill(os.getpid(), signal.SIGKILL)

    CheckpointManager.mark_step = crash_after  # type: ignore[method-assign]
    train_regression.main(sys.argv[1:])


if __name__ == "__main__":
    main()
