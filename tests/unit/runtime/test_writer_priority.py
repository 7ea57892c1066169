"""An asynchronous save's writer thread runs at the lowest priority; the training thread
keeps its own (checkpoints/writer_priority.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import torch

from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.checkpoints.writer_priority import (
    WRITER_NICE,
    thread_nice,
    yield_cpu_to_training,
)


class NiceWitness:
    """Records the nice value of each thread that pickles it (torch.save does, in the
    writer thread); the save's CPU snapshot keeps it as it is."""

    seen: ClassVar[list[tuple[str, int]]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> NiceWitness:
        return self

    def __reduce__(self) -> tuple[type, tuple[()]]:
        NiceWitness.seen.append((threading.current_thread().name, thread_nice()))
        return (NiceWitness, ())


def test_only_the_calling_thread_yields() -> None:
    before = thread_nice()
    seen: dict[str, object] = {}

    def lowered() -> None:
        seen["took"] = yield_cpu_to_training()
        seen["nice"] = thread_nice()

    t = threading.Thread(target=lowered)
    t.start()
    t.join()
    assert seen == {"took": True, "nice": WRITER_NICE}
    assert thread_nice() == before


def test_an_async_save_is_written_at_the_writers_priority(tmp_path: Path) -> None:
    NiceWitness.seen.clear()
    training = thread_nice()
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True, memory=False, writer=True)
    mgr.save({"weights": torch.ones(4), "witness": NiceWitness()}, 1)
    mgr.wait()
    mgr.close()
    assert NiceWitness.seen == [("checkpoint-1", WRITER_NICE)]
    assert thread_nice() == training  # the training thread's priority is its own


def test_a_blocking_save_runs_at_the_callers_priority(tmp_path: Path) -> None:
    NiceWitness.seen.clear()
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=False, memory=False, writer=True)
    mgr.save({"witness": NiceWitness()}, 1)
    mgr.close()
    assert NiceWitness.seen == [(threading.current_thread().name, thread_nice())]
