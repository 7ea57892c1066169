"""Checkpoints: atomic, verified, pruned, asynchronous, in node memory."""

from __future__ import annotations

import errno
import functools
import io
import logging
import resource
import signal
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elasticjob_runtime.checkpoints.files import (
    checkpoint_name,
    commit,
    committed_steps,
    read_verified,
)
from elasticjob_runtime.checkpoints.format import (
    CheckpointError,
    UnsafeCheckpointError,
    deserialize,
    serialize,
    serialize_into,
)
from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.etcd.progress import memory_fallback_reporter_from_env
from elasticjob_runtime.etcd.records import MemoryFallback
from elasticjob_runtime.training.sampler import ElasticSampler


@dataclass
class Extra:
    """Picklable extra state that the safe (weights_only) loader reads once registered."""

    note: str
    losses: list[float]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def manager(tmp_path: Path, **kw: object) -> CheckpointManager:
    kw.setdefault("memory_dir", tmp_path / "shm")
    return CheckpointManager(tmp_path / "ckpt", writer=True, memory_writer=True, **kw)  # type: ignore[arg-type]


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def test_restore_brings_back_model_optimizer_sampler_and_extra_state(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = ElasticSampler(100, 0, 1, seed=3)
    for _ in range(3):
        train_step(model, opt)
    sampler.advance(48)
    mgr = manager(tmp_path, memory=False)
    mgr.save({"model": model, "optim": opt, "sampler": sampler, "extra": Extra("hi", [1.5])}, 3)

    model2, sampler2 = make_model(seed=1), ElasticSampler(100, 0, 1, seed=3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    with torch.serialization.safe_globals([Extra]):  # the user vouches for their class
        ckpt = manager(tmp_path, memory=False).restore(
            {"model": model2, "optim": opt2, "sampler": sampler2}
        )
    assert ckpt is not None and ckpt.step == 3
    assert same_params(model, model2)
    assert opt2.state_dict()["state"][0]["step"] == 3
    assert sampler2.consumed == 48
    assert ckpt.state["extra"] == Extra("hi", [1.5])


def test_ddp_module_is_saved_unwrapped_and_restores_into_ddp_or_plain(tmp_path: Path) -> None:
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(make_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train_step(ddp, opt)
        manager(tmp_path, memory=False).save({"model": ddp}, 1)
        ckpt = manager(tmp_path, memory=False).load_latest()
        assert ckpt is not None
        assert not any(k.startswith("module.") for k in ckpt.state["model"])
        plain = make_model(seed=5)
        manager(tmp_path, memory=False).restore({"model": plain})
        assert same_params(ddp.module, plain)
        other = torch.nn.parallel.DistributedDataParallel(make_model(seed=6))
        manager(tmp_path, memory=False).restore({"model": other})
        assert same_params(ddp.module, other.module)
    finally:
        torch.distributed.destroy_process_group()


def test_only_the_last_k_checkpoints_are_kept(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep=2)
    for step in range(1, 6):
        mgr.save({"x": torch.tensor(step)}, step)
    assert committed_steps(tmp_path / "ckpt") == [4, 5]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        checkpoint_name(4),
        checkpoint_name(4) + ".commit",
        checkpoint_name(5),
        checkpoint_name(5) + ".commit",
    ]
    assert committed_steps(tmp_path / "shm") == [5]  # node memory keeps only the newest


def _save_three(tmp_path: Path) -> CheckpointManager:
    mgr = manager(tmp_path, memory=False)
    for step in (1, 2, 3):
        mgr.save({"x": torch.full((1000,), float(step))}, step)
    return mgr


def _newest(tmp_path: Path) -> Path:
    return tmp_path / "ckpt" / checkpoint_name(3)


def test_truncated_newest_checkpoint_falls_back_to_previous_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = _save_three(tmp_path)
    newest = _newest(tmp_path)
    with newest.open("r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.checkpoints.restore"):
        ckpt = mgr.load_latest()
    assert ckpt is not None and ckpt.step == 2
    assert float(ckpt.state["x"][0]) == 2.0
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 1
    assert str(newest) in skipped[0] and "truncated" in skipped[0]


def test_flipped_bytes_in_newest_checkpoint_fail_the_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = _save_three(tmp_path)
    newest = _newest(tmp_path)
    raw = bytearray(newest.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 8):
        raw[i] ^= 0xFF
    newest.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.checkpoints.restore"):
        ckpt = mgr.load_latest()
    assert ckpt is not None and ckpt.step == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping checkpoint {newest}: checksum mismatch (file corrupted)"
    ]


def test_checkpoint_without_commit_marker_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = _save_three(tmp_path)
    (tmp_path / "ckpt" / (checkpoint_name(3) + ".commit")).unlink()
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.checkpoints.restore"):
        ckpt = mgr.load_latest()
    assert ckpt is not None and ckpt.step == 2
    assert "no commit marker" in caplog.records[0].getMessage()


def test_no_checkpoint_yet_gives_none_and_restore_changes_nothing(tmp_path: Path) -> None:
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert manager(tmp_path).restore({"model": model}) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_async_save_snapshots_so_training_can_go_on(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mgr = manager(tmp_path, async_save=True)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.save({"model": model}, 1)
    for _ in range(5):  # changes the live tensors while the save may still be running
        train_step(model, opt)
    mgr.close()
    ckpt = CheckpointManager(tmp_path / "ckpt", memory=False).load_latest()
    assert ckpt is not None and ckpt.step == 1
    assert all(torch.equal(at_save[k], v) for k, v in ckpt.state["model"].items())
    assert not same_params(model, make_model())  # the model did move on


def test_async_saves_in_reused_buffers_each_hold_their_own_step(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    train_step(model, opt)
    mgr = manager(tmp_path, async_save=True, keep=3)
    at_save = {}
    for step in (1, 2, 3):  # the 2nd and 3rd copy into the 1st one's CPU buffers
        at_save[step] = {k: v.clone() for k, v in model.state_dict().items()}
        mgr.save({"model": model, "optim": opt}, step)
        train_step(model, opt)
    mgr.close()
    for step, expected in at_save.items():
        data, reason = read_verified(tmp_path / "ckpt", step)
        assert data is not None, reason
        saved = deserialize(data)["model"]
        assert all(torch.equal(expected[k], v) for k, v in saved.items()), step


def test_an_async_save_counts_as_saved_only_once_it_is_written(tmp_path: Path) -> None:
    """the Run reports ``saved_step`` as the job's checkpoint step, and does not save
    a step again while its save is ``pending_step``."""
    mgr = manager(tmp_path, async_save=True)
    assert (mgr.saved_step, mgr.pending_step) == (None, None)
    mgr.save({"x": torch.ones(1)}, 4)
    assert mgr.pending_step == 4 and mgr.saved_step in (None, 4)  # 4 once the thread is done
    mgr.wait()
    assert (mgr.saved_step, mgr.pending_step) == (4, None)
    assert committed_steps(tmp_path / "ckpt") == [4]
    mgr.close()


def test_async_save_error_is_raised_on_the_next_call(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    mgr = CheckpointManager(blocker / "ckpt", async_save=True, memory=False, writer=True)
    mgr.save({"x": torch.zeros(3)}, 1)  # returns at once; the write fails in the background
    with pytest.raises(
        CheckpointError, match=r"saving checkpoint step 1 to .*not-a-dir/ckpt failed"
    ):
        mgr.save({"x": torch.zeros(3)}, 2)


def test_sync_save_error_is_one_checkpoint_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    mgr = CheckpointManager(blocker / "ckpt", memory=False, writer=True)
    with pytest.raises(
        CheckpointError, match=r"saving checkpoint step 3 to .*not-a-dir/ckpt failed"
    ):
        mgr.save({"x": torch.zeros(3)}, 3)


def test_async_save_error_is_raised_at_close(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    mgr = CheckpointManager(blocker / "ckpt", async_save=True, memory=False, writer=True)
    mgr.save({"x": torch.zeros(3)}, 7)
    with pytest.raises(CheckpointError, match="step 7"):
        mgr.close()


def test_restarted_worker_reloads_from_node_memory_without_disk(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save({"x": torch.tensor([1.0])}, 1)
    mgr.save({"x": torch.tensor([2.0])}, 2)
    for f in (tmp_path / "ckpt").iterdir():  # the disk copy is gone (or slow, or remote)
        f.unlink()
    ckpt = manager(tmp_path).load_latest()  # a fresh manager, as in a restarted process
    assert ckpt is not None and ckpt.step == 2
    assert ckpt.path.parent == tmp_path / "shm"


def test_failing_memory_copy_warns_once_and_the_disk_copy_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "shm-full"
    blocker.write_text("stands in for a full /dev/shm")
    mgr = manager(tmp_path, memory_dir=blocker / "run")
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.checkpoints.save_faults"):
        mgr.save({"x": torch.ones(1)}, 1)
        mgr.save({"x": torch.ones(1)}, 2)
    [record] = caplog.records
    assert "node-memory checkpoint copy" in record.getMessage()
    assert committed_steps(tmp_path / "ckpt") == [1, 2]


def test_a_failing_memory_copy_is_reported_once_with_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICJOB_POD_NAME", "train-worker-3")
    reports: list[MemoryFallback] = []
    blocker = tmp_path / "shm-full"
    blocker.write_text("not a directory")
    mgr = manager(tmp_path, memory_dir=blocker / "run", on_memory_fallback=reports.append)
    mgr.save({"x": torch.ones(1000)}, 7)
    mgr.save({"x": torch.ones(1000)}, 8)
    [report] = reports
    size = (tmp_path / "ckpt" / checkpoint_name(8)).stat().st_size
    assert (report.pod, report.step, report.checkpoint_bytes) == ("train-worker-3", 7, size)
    assert not report.no_space and "Not a directory" in report.error
    assert report.shm_bytes is not None and report.shm_bytes > 0  # the parent filesystem's


def test_a_rank_that_writes_node_memory_alone_reports_its_tensors_bytes(
    tmp_path: Path,
) -> None:
    reports: list[MemoryFallback] = []
    blocker = tmp_path / "shm-full"
    blocker.write_text("not a directory")
    mgr = CheckpointManager(
        tmp_path / "ckpt",
        memory_dir=blocker / "run",
        writer=False,  # a node's local rank 0 that is not the global rank 0
        memory_writer=True,
        on_memory_fallback=reports.append,
    )
    mgr.save({"x": torch.ones(1000), "y": torch.zeros(10, dtype=torch.float64)}, 7)
    [report] = reports
    assert report.checkpoint_bytes == 4000 + 80  # no copy written: the tensors' bytes


def test_the_disk_and_node_memory_copies_are_the_bytes_torch_save_makes(tmp_path: Path) -> None:
    model = make_model()
    state = {"model": model, "note": "text"}
    manager(tmp_path).save(state, 3)
    expected = serialize({"model": model.state_dict(), "note": "text"})
    assert read_verified(tmp_path / "ckpt", 3) == (expected, "")
    assert read_verified(tmp_path / "shm", 3) == (expected, "")


def _zip_crcs(data: bytes) -> list[int]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [info.CRC for info in archive.infolist() if info.file_size]


@pytest.mark.parametrize("scripts_own", [True, False])
def test_our_saves_skip_torchs_zip_crc_and_leave_the_scripts_own_setting(
    scripts_own: bool,
) -> None:
    tensors = {"w": torch.arange(4096, dtype=torch.float32)}
    torch.serialization.set_crc32_options(scripts_own)
    try:
        ours = serialize(tensors)
        assert torch.serialization.get_crc32_options() is scripts_own
        plain = io.BytesIO()
        torch.save(tensors, plain)
    finally:
        torch.serialization.set_crc32_options(True)
    assert set(_zip_crcs(ours)) == {0}  # nothing computed: the marker's SHA-256 checks it
    assert (0 not in _zip_crcs(plain.getvalue())) is scripts_own
    assert torch.equal(deserialize(ours)["w"], tensors["w"])


def test_saves_in_threads_leave_the_crc_setting_as_it_was() -> None:
    big = {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MiB: the saves overlap
    saved: list[bytes] = []
    threads = [threading.Thread(target=lambda: saved.append(serialize(big))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.serialization.get_crc32_options() is True
    assert len(saved) == 4 and all(torch.equal(deserialize(d)["w"], big["w"]) for d in saved)
    alone: list[bytes] = []  # as the checkpoint writer saves: in a thread of its own
    writer = threading.Thread(target=lambda: alone.append(serialize(big)))
    writer.start()
    writer.join()
    assert set(_zip_crcs(alone[0])) == {0}


def test_a_write_that_fails_inside_torch_save_raises_its_own_os_error(tmp_path: Path) -> None:
    # torch.save's zip writer, closing on the way out, raises a RuntimeError of its own
    # ("unexpected pos"): the manager must still see the OSError (a full disk is a fault
    # it survives). A file size limit makes the kernel refuse the write past 4 KiB.
    state = {"model": make_model().state_dict(), "big": torch.zeros(10_000)}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(OSError) as raised:
            commit(tmp_path, 1, functools.partial(serialize_into, state))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert raised.value.errno == errno.EFBIG
    assert list(tmp_path.iterdir()) == []  # nor a temp file left


def test_without_an_etcd_endpoint_a_memory_fallback_is_only_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PET_RDZV_ENDPOINT", raising=False)
    assert memory_fallback_reporter_from_env() is None
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "worker-0:29400")
    monkeypatch.setenv("PET_RDZV_ID", "run")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")  # a TCPStore, not an etcd
    assert memory_fallback_reporter_from_env() is None
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd-v3")
    assert memory_fallback_reporter_from_env() is not None
    monkeypatch.setenv("ELASTICJOB_PROGRESS", "0")
    assert memory_fallback_reporter_from_env() is None


def test_node_memory_copy_is_preferred_at_equal_step(tmp_path: Path) -> None:
    manager(tmp_path).save({"x": torch.tensor([2.0])}, 2)
    ckpt = manager(tmp_path).load_latest()
    assert ckpt is not None and ckpt.path == tmp_path / "shm" / checkpoint_name(2)


def test_newer_disk_checkpoint_wins_over_older_memory_copy(tmp_path: Path) -> None:
    manager(tmp_path).save({"x": torch.tensor([1.0])}, 1)
    CheckpointManager(tmp_path / "ckpt", memory=False, writer=True).save({"x": torch.ones(1)}, 5)
    ckpt = manager(tmp_path).load_latest()
    assert ckpt is not None and ckpt.step == 5


def test_non_writer_rank_writes_nothing(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt", writer=False, memory_writer=False)
    mgr.save({"x": torch.zeros(1)}, 1)
    assert not (tmp_path / "ckpt").exists()


def test_missing_directory_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTICJOB_CHECKPOINT_DIR", raising=False)
    with pytest.raises(CheckpointError, match="set ELASTICJOB_CHECKPOINT_DIR"):
        CheckpointManager()


def test_directory_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICJOB_CHECKPOINT_DIR", str(tmp_path / "env-ckpt"))
    monkeypatch.setenv("ELASTICJOB_CHECKPOINT_MEMORY_DIR", "off")
    mgr = CheckpointManager(writer=True)
    assert mgr.memory_dir is None
    mgr.save({"x": torch.zeros(1)}, 4)
    assert committed_steps(tmp_path / "env-ckpt") == [4]


def leave_mark(path: str) -> str:
    """What a hostile checkpoint would run on load: here it only leaves a file."""
    Path(path).write_text("code ran")
    return "loaded"


class RunsCodeOnLoad:
    """Unpickling this calls ``leave_mark`` (any callable could be named instead)."""

    def __init__(self, mark: Path) -> None:
        self.mark = str(mark)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (leave_mark, (self.mark,))


def test_a_checkpoint_that_would_run_code_is_refused_and_the_code_never_runs(
    tmp_path: Path,
) -> None:
    mark = tmp_path / "mark"
    manager(tmp_path).save({"x": torch.ones(2), "evil": RunsCodeOnLoad(mark)}, 5)
    with pytest.raises(UnsafeCheckpointError) as refused:
        manager(tmp_path).restore({})
    message = str(refused.value)
    assert "needs test_checkpoint.leave_mark" in message
    assert str(tmp_path / "shm" / checkpoint_name(5)) in message
    assert "weights_only=False" in message and "add_safe_globals" in message
    assert not mark.exists()
    with pytest.raises(UnsafeCheckpointError):  # the disk copy is refused alike
        manager(tmp_path, memory=False).load_latest()
    assert not mark.exists()


def test_bytes_from_a_peer_are_never_unpickled_unless_allowed(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    data = serialize({"evil": RunsCodeOnLoad(mark)})
    with pytest.raises(UnsafeCheckpointError, match="checkpoint step 9 from rank 0 needs"):
        deserialize(data, source="step 9 from rank 0")
    assert not mark.exists()


def test_weights_only_false_loads_a_trusted_checkpoint(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    manager(tmp_path).save({"evil": RunsCodeOnLoad(mark)}, 5)
    ckpt = manager(tmp_path).load_latest(weights_only=False)
    assert ckpt is not None and ckpt.state["evil"] == "loaded"
    assert mark.read_text() == "code ran"  # the opt-in really unpickles


def test_the_runtimes_own_state_loads_with_the_safe_loader(tmp_path: Path) -> None:
    model = make_model()
    opts = [
        torch.optim.Adam(model.parameters(), lr=0.01),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(model.parameters(), lr=0.01),
    ]
    sched = torch.optim.lr_scheduler.StepLR(opts[1], step_size=2)
    for opt in opts:
        train_step(model, opt)
    sched.step()
    sampler = ElasticSampler(100, 0, 1, seed=3)
    run = {"step": 3, "samples": 48, "meta": {"best": 1.5, "note": "x", "hist": [1, 2]}}
    state = {"model": model, "sampler": sampler, "sched": sched, "run": run}
    state.update({f"opt{i}": opt for i, opt in enumerate(opts)})
    manager(tmp_path).save(state, 3)
    ckpt = manager(tmp_path, memory=False).load_latest()  # weights_only=True throughout
    assert ckpt is not None and ckpt.state["run"] == run
    assert ckpt.state["sched"]["last_epoch"] == 1


def test_a_node_memory_checkpoint_of_another_job_is_skipped_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager(tmp_path, job="torchrun/none@a:1").save({"x": torch.tensor([1.0])}, 8)
    manager(tmp_path, job="torchrun/none@b:1", memory=False).save({"x": torch.tensor([2.0])}, 2)
    for f in (tmp_path / "ckpt").iterdir():
        if f.name.startswith(checkpoint_name(8)):
            f.unlink()  # job a's disk copy is elsewhere; its memory copy sits in b's way
    with caplog.at_level(logging.WARNING, logger="elasticjob_runtime.checkpoints.restore"):
        ckpt = manager(tmp_path, job="torchrun/none@b:1").load_latest()
    assert ckpt is not None and ckpt.step == 2 and float(ckpt.state["x"][0]) == 2.0
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping checkpoint {tmp_path / 'shm' / checkpoint_name(8)}: written by another "
        "job ('torchrun/none@a:1'; this is 'torchrun/none@b:1')"
    ]


def test_a_checkpoint_directory_you_name_is_read_whoever_wrote_it(tmp_path: Path) -> None:
    """A re-created job (new uid) resumes from the directory its predecessor used."""
    old = CheckpointManager(tmp_path / "ckpt", memory=False, writer=True, job="k8s/ml/u1/u1")
    old.save({"x": torch.tensor([4.0])}, 40)
    new = CheckpointManager(tmp_path / "ckpt", memory=False, job="k8s/ml/u2/u2")
    ckpt = new.load_latest()
    assert ckpt is not None and ckpt.step == 40
