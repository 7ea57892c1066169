"""Ranks of a small gloo group spawned by a cost scenario (check_cost.py, ledger_cost.py):
each one's environment as a launcher would set it, and the driver's clean-up.

A spawned rank inherits the bench's environment, which may hold a launcher's or a
run's variables; it must see only its own rank and world, or the Run would take the
inherited ones for a rendezvous.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any


def as_rank(rank: int, world_size: int, port: int) -> None:
    """This process is rank ``rank`` of ``world_size`` on loopback ``port`` and nothing
    else: the launchers' and the runtime's variables it inherited are dropped."""
    for name in list(os.environ):
        if name.startswith(("TORCHELASTIC_", "ELASTICJOB_", "PET_")):
            del os.environ[name]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def stop_spawned(procs: Iterable[BaseProcess], results: Any, directory: Path) -> None:
    """Join the ranks (killing one that does not end: our own child, by its handle), close
    their results queue and remove their directory."""
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    with contextlib.suppress(Exception):
        results.close()
    shutil.rmtree(directory, ignore_errors=True)
