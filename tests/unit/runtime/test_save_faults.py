"""A save the directory refuses fails alone: said once per errno, kept in one line, and
forgotten once a save works again."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from elasticjob_runtime.checkpoints.save_faults import SaveFaults, write_fault_message


def full(directory: Path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(directory))


def test_the_message_names_the_step_the_errno_and_what_stands() -> None:
    msg = write_fault_message(Path("/ckpt"), 9, full(Path("/ckpt")), [8])
    assert msg == (
        "checkpoint step 9 not saved in /ckpt: ENOSPC (No space left on device); "
        "step 8, the newest checkpoint there, stands and training goes on"
    )
    assert "nothing was saved there before" in write_fault_message(
        Path("/ckpt"), 1, full(Path("/ckpt")), []
    )


def test_each_kind_of_fault_is_said_once_until_saves_work_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = SaveFaults(on_memory_fallback=lambda report: None)
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.checkpoints.save_faults"):
        faults.disk_failed(tmp_path, 1, full(tmp_path))
        faults.disk_failed(tmp_path, 2, full(tmp_path))
        faults.disk_failed(tmp_path, 3, OSError(errno.EROFS, "Read-only file system"))
        assert faults.save_error is not None and "step 3" in faults.save_error
        faults.disk_saved(tmp_path, 4)
        faults.disk_failed(tmp_path, 5, full(tmp_path))
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in said] == [
        "checkpoint step 1 not saved in " + str(tmp_path),
        "checkpoint step 3 not saved in " + str(tmp_path),
        "checkpoint step 4 saved in " + str(tmp_path),
        "checkpoint step 5 not saved in " + str(tmp_path),
    ]
