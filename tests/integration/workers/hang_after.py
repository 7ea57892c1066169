"""A worker that marks ``HANG_AFTER`` steps, then sleeps for ever in its step (a deadlock
that never exits and never frees its agent), printing ``step=N attempt=A`` as it goes.

``ELASTICJOB_RESULT`` of a run that finishes is never printed: every attempt hangs.
"""

from __future__ import annotations

import os
import time

from elasticjob_runtime.checkpoints.manager import CheckpointManager


def main() -> None:
    ckpt = CheckpointManager(os.environ["CKPT_DIR"])
    ckpt.install_sigterm_handler()
    ckpt.track({"step": 0})
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    for step in range(1, int(os.environ["HANG_AFTER"]) + 1):
        time.sleep(0.05)
        ckpt.mark_step(step)
        print(f"step={step} attempt={attempt}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
