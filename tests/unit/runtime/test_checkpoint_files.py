"""Checkpoint files without torch: a commit is durable and verified, pruning keeps the newest."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticjob_runtime.checkpoint_files import (
    CommitRecord,
    checkpoint_name,
    commit,
    committed_steps,
    default_memory_dir,
    prune,
    read_verified,
)


def test_a_commit_reads_back_verified_and_a_partial_save_does_not(tmp_path: Path) -> None:
    commit(tmp_path, 7, b"seven")
    (tmp_path / checkpoint_name(9)).write_bytes(b"a save that never got its marker")
    assert committed_steps(tmp_path) == [7]
    assert read_verified(tmp_path, 7) == (b"seven", "")
    assert read_verified(tmp_path, 9) == (None, "no commit marker (the save did not finish)")
    (tmp_path / checkpoint_name(7)).write_bytes(b"SEVEN")  # same size, other bytes
    assert read_verified(tmp_path, 7) == (None, "checksum mismatch (file corrupted)")


def test_prune_keeps_the_newest_and_drops_abandoned_saves(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        commit(tmp_path, step, b"x" * step)
    (tmp_path / checkpoint_name(0)).write_bytes(b"abandoned")  # older than a commit
    (tmp_path / checkpoint_name(4)).write_bytes(b"maybe still being written")
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        checkpoint_name(2),
        checkpoint_name(2) + ".commit",
        checkpoint_name(3),
        checkpoint_name(3) + ".commit",
        checkpoint_name(4),
    ]


def test_a_marker_naming_another_step_is_refused() -> None:
    wrong = CommitRecord(step=3, file=checkpoint_name(4), size=1, sha256="0")
    with pytest.raises(ValueError, match=r"marker names 'step-0000000004\.pt' for step 3"):
        CommitRecord.from_bytes(wrong.to_bytes())


def test_node_memory_directory_is_per_run_and_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICJOB_CHECKPOINT_MEMORY_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTICJOB_POD_NAME", "job-worker-1")
    assert default_memory_dir("uid/1") == tmp_path / "elasticjob" / "uid_1" / "job-worker-1"
    monkeypatch.setenv("ELASTICJOB_CHECKPOINT_MEMORY_DIR", "off")
    assert default_memory_dir("uid/1") is None
