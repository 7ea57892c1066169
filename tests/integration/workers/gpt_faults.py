"""examples/train_gpt.py with faults at exact steps, so a faulted run and an unfaulted run
can have the same world history and be compared step by step.

After the group commits step N (environment variables, all optional):

* ``CRASH_AT_STEP`` / ``CRASH_RANK``: that rank's worker SIGKILLs itself (first attempt);
* ``HOLD_AT_STEP``: every worker waits until its agent has a new round for it (a node
  that the test starts once it sees ``held at step N`` joins), so the world changes
  after exactly that step in every run;
* ``LOSE_NODE_AT_STEP`` / ``LOSE_NODE_RANK``: that rank SIGKILLs its agent and itself
  (a node lost at once, as when a VM dies);
* ``UNREGISTERED``: names of ``state=`` entries that ``run.wrap`` does not get (the
  script forgets to register them).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from elasticjob_examples import train_gpt

from elasticjob_runtime import elastic


def _at(name: str) -> int:
    return int(os.environ.get(name, "-1"))


def main() -> None:
    commit, wrap = elastic.Run._commit, elastic.Run.wrap
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dropped = {n for n in os.environ.get("UNREGISTERED", "").split(",") if n}

    def faulty_commit(self: elastic.Run) -> None:
        commit(self)
        step, rank = self.global_step, str(self.rank)
        if step == _at("CRASH_AT_STEP") and first_attempt and rank == os.environ["CRASH_RANK"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == _at("LOSE_NODE_AT_STEP") and rank == os.environ["LOSE_NODE_RANK"]:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == _at("HOLD_AT_STEP") and self.world_size == int(os.environ["HOLD_WORLD"]):
            print(f"held at step {step} rank={self.rank}", flush=True)
            deadline = time.monotonic() + 240
            while not self._switch_pending() and time.monotonic() < deadline:
                time.sleep(0.05)

    def forgetful_wrap(self: elastic.Run, *args: Any, state: Any = None, **kw: Any) -> Any:
        kept = {k: v for k, v in (state or {}).items() if k not in dropped}
        return wrap(self, *args, state=kept, **kw)

    elastic.Run._commit = faulty_commit  # type: ignore[method-assign]
    elastic.Run.wrap = forgetful_wrap  # type: ignore[method-assign]
    train_gpt.main(sys.argv[1:])


if __name__ == "__main__":
    main()
