"""The regression example, with its worker holding still where training has ended, so a
test can bring a new node in at that moment.

``LINGER_AT=finish``: after the training loop, before ``Run.finish()`` (the agent still
counts on the worker to regroup in place). ``LINGER_AT=finished``: inside ``finish()``,
right after the worker told its agent it finished. The worker writes
``$LINGER_DIR/lingering-<pid>`` and goes on once ``$LINGER_DIR/go`` exists (at most
300 s).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticjob_examples import train_regression

from elasticjob_runtime import Run
from elasticjob_runtime.launch.channel import WorkerChannel


def linger() -> None:
    where = Path(os.environ["LINGER_DIR"])
    (where / f"lingering-{os.getpid()}").write_text("")
    deadline = time.monotonic() + 300
    while not (where / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def lingering_after(method: Callable[..., Any], before: bool) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            linger()
        result = method(*args, **kwargs)
        if not before:
            linger()
        return result

    return wrapped


def main() -> None:
    if os.environ["LINGER_AT"] == "finish":
        Run.finish = lingering_after(Run.finish, before=True)  # type: ignore[method-assign]
    else:
        WorkerChannel.say_finished = lingering_after(WorkerChannel.say_finished, before=False)  # type: ignore[method-assign]
    train_regression.main(sys.argv[1:])


if __name__ == "__main__":
    main()
