"""Checkpoint files without torch: a commit is durable and verified, pruning keeps the newest."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import pytest

from elasticjob_runtime.checkpoints.files import (
    CommitRecord,
    Sink,
    checkpoint_name,
    commit,
    committed_steps,
    default_memory_dir,
    prune,
    read_record,
    read_verified,
    remove_memory_copy,
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


def test_node_memory_directory_is_per_job_and_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICJOB_CHECKPOINT_MEMORY_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTICJOB_POD_NAME", "job-worker-1")
    one = default_memory_dir("torchrun/none@10.0.0.1:2379")
    other = default_memory_dir("torchrun/none@10.0.0.2:2379")
    assert one is not None and other is not None and one != other  # same run id "none"
    assert one.parent.parent == tmp_path / "elasticjob" and one.name == "job-worker-1"
    assert one.parent.name.startswith("none-")
    assert default_memory_dir("torchrun/none@10.0.0.1:2379") == one  # stable: restarts find it
    monkeypatch.setenv("ELASTICJOB_CHECKPOINT_MEMORY_DIR", "off")
    assert default_memory_dir("k8s/ml/uid/uid") is None


def test_private_directories_are_0700_and_the_shared_root_1777(tmp_path: Path) -> None:
    shared = tmp_path / "elasticjob"
    memory = shared / "job-0123" / "pod-a"
    commit(memory, 1, b"state", job="job", private=True, shared=shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE(memory.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(memory.stat().st_mode) == 0o700


def test_a_checkpoint_of_another_job_is_refused_before_its_data_is_read(tmp_path: Path) -> None:
    commit(tmp_path, 3, b"theirs", job="torchrun/none@a:1")
    assert read_verified(tmp_path, 3, "torchrun/none@a:1") == (b"theirs", "")
    data, reason = read_verified(tmp_path, 3, "torchrun/none@b:1")
    assert data is None
    assert reason == "written by another job ('torchrun/none@a:1'; this is 'torchrun/none@b:1')"
    assert read_verified(tmp_path, 3) == (b"theirs", "")  # no job given: not checked


def test_a_failed_marker_write_leaves_nothing_and_keeps_the_last_commit(tmp_path: Path) -> None:
    commit(tmp_path, 1, b"good")
    (tmp_path / (checkpoint_name(2) + ".commit")).mkdir()  # the marker's rename must fail
    with pytest.raises(OSError):
        commit(tmp_path, 2, b"newer")
    assert not (tmp_path / checkpoint_name(2)).exists()  # its data file went too
    assert [p.name for p in tmp_path.iterdir() if ".tmp." in p.name] == []  # and the temps
    assert read_verified(tmp_path, 1) == (b"good", "")


def test_prune_never_removes_the_step_just_committed(tmp_path: Path) -> None:
    for step in (100, 200, 300):  # an earlier run's, in the directory a new run reuses
        commit(tmp_path, step, b"old")
    commit(tmp_path, 10, b"new")
    prune(tmp_path, 3, protect=10)
    assert committed_steps(tmp_path) == [10, 100, 200, 300]
    prune(tmp_path, 1, protect=10)
    assert committed_steps(tmp_path) == [10, 300]


def test_a_finished_jobs_memory_copy_goes_and_its_job_directory_once_empty(
    tmp_path: Path,
) -> None:
    job = tmp_path / "elasticjob" / "run-0123"
    pod_a, pod_b = job / "pod-a", job / "pod-b"
    commit(pod_a, 3, b"a", private=True, shared=tmp_path / "elasticjob")
    commit(pod_b, 3, b"b", private=True, shared=tmp_path / "elasticjob")
    assert remove_memory_copy(pod_a)
    assert not pod_a.exists() and committed_steps(pod_b) == [3]  # another pod's stays
    assert remove_memory_copy(pod_b)
    assert not job.exists() and (tmp_path / "elasticjob").is_dir()  # the shared root stays
    assert not remove_memory_copy(pod_b)  # nothing there: nothing to say


def _in_pieces(sink: Sink) -> None:
    """As ``torch.save`` writes: small records and memoryviews of large buffers."""
    sink.write(b"header")
    sink.write(memoryview(bytes(range(256)) * 4096))
    sink.write(b"")


def test_a_streamed_save_and_its_kernel_copy_commit_the_same_verified_bytes(
    tmp_path: Path,
) -> None:
    expected = b"header" + bytes(range(256)) * 4096
    first = commit(tmp_path / "disk", 5, _in_pieces, job="j")
    second = commit(tmp_path / "memory", 5, first, job="j", private=True)
    assert (first.size, first.sha256) == (len(expected), hashlib.sha256(expected).hexdigest())
    assert (second.size, second.sha256) == (first.size, first.sha256)
    for directory in (tmp_path / "disk", tmp_path / "memory"):
        assert read_verified(directory, 5, "j") == (expected, "")
        assert read_record(directory, 5).sha256 == first.sha256
    assert second.path == tmp_path / "memory" / checkpoint_name(5)


def test_a_save_that_fails_while_streaming_leaves_nothing_and_keeps_the_last_commit(
    tmp_path: Path,
) -> None:
    commit(tmp_path, 1, b"good")

    def broken(sink: Sink) -> None:
        sink.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        commit(tmp_path, 2, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        checkpoint_name(1),
        checkpoint_name(1) + ".commit",
    ]


def test_a_copy_where_the_kernel_cannot_sendfile_goes_through_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = commit(tmp_path / "disk", 3, b"state" * 1000)

    def unsupported(*_: object) -> int:  # as some FUSE and network filesystems answer
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "sendfile", unsupported)
    commit(tmp_path / "memory", 3, first)
    assert read_verified(tmp_path / "memory", 3) == (b"state" * 1000, "")


def test_a_copy_of_a_file_that_shrank_fails_and_commits_nothing(tmp_path: Path) -> None:
    first = commit(tmp_path / "disk", 3, b"state" * 1000)
    first.path.write_bytes(b"state")  # truncated after its commit
    with pytest.raises(OSError, match="ended at byte 5 of 5000"):
        commit(tmp_path / "memory", 3, first)
    assert committed_steps(tmp_path / "memory") == []
