"""The regression example whose worker forks a child that outlives it unless killed.

Every worker starts ``sleep 600`` in its own process group (the way a DataLoader
worker or a helper process of a script lives) and writes the child's pid to
``$ORPHAN_DIR/<pid>``. With ``CRASH_AT_STEP``, global rank 1 SIGKILLs itself after that
step on its first attempt: its child is then an orphan that never notices.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from crash_once import main as crash_once_main  # beside this script: on sys.path


def main() -> None:
    child = subprocess.Popen(["sleep", "600"])  # same session: the worker's
    (Path(os.environ["ORPHAN_DIR"]) / str(os.getpid())).write_text(str(child.pid))
    crash_once_main()


if __name__ == "__main__":
    main()
