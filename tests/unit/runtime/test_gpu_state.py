"""Training state on a GPU through the async save's copy and a restore (bench/gpu.py runs
these on a lent GPU; on CPU they skip, saying so)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticjob_runtime.checkpoints.manager import CheckpointManager
from elasticjob_runtime.checkpoints.snapshot import Snapshots

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh runs it on one)"
)


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64, device="cuda")).pow(2).mean().backward()
    optim.step()
    return model, optim


def test_a_snapshot_of_gpu_state_lands_in_pinned_buffers_reused_by_the_next() -> None:
    model, _ = model_and_optimizer(0)
    snapshots = Snapshots()
    first = snapshots.take(model.state_dict())
    assert all(t.device.type == "cpu" and t.is_pinned() for t in first.values())
    assert all(torch.equal(first[k], v.cpu()) for k, v in model.state_dict().items())
    pointers = {k: t.data_ptr() for k, t in first.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = snapshots.take(model.state_dict())
    assert {k: t.data_ptr() for k, t in second.items()} == pointers  # the same buffers
    assert all(torch.equal(second[k], v.cpu()) for k, v in model.state_dict().items())


def test_gpu_state_saved_asynchronously_comes_back_bitwise_onto_the_gpu(tmp_path: Path) -> None:
    model, optim = model_and_optimizer(0)
    ckpt = CheckpointManager(tmp_path, async_save=True, memory=False)
    ckpt.save({"model": model, "optim": optim}, 7)
    ckpt.close()
    other, other_optim = model_and_optimizer(1)
    back = CheckpointManager(tmp_path, memory=False).restore(
        {"model": other, "optim": other_optim}, sync=False
    )
    assert back is not None and back.step == 7
    for (name, p), q in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert q.is_cuda and torch.equal(p, q), name
    mine, theirs = optim.state_dict()["state"], other_optim.state_dict()["state"]
    for index, state in mine.items():
        for key, value in state.items():
            back = torch.as_tensor(theirs[index][key])
            assert torch.equal(torch.as_tensor(value).cpu(), back.cpu()), (index, key)
            assert back.is_cuda or key == "step", key


def test_shard_rows_held_in_cpu_copies_reach_a_shard_on_the_gpu() -> None:
    # A rollback to shard copies: the rows sit in CPU memory (shard_copies.py), the new
    # shard is on the GPU, and gloo's all-to-all takes tensors of one device. The first
    # GPU run found the survivor failing here ("output tensor and input tensor must be on
    # the same type of device"); the rows now travel on the group's device.
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from elasticjob_runtime.training.reshard import ShardMove, exchange_all

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        whole = torch.arange(12.0).reshape(6, 2)
        held = {0: whole[:3].clone(), 1: whole[3:].clone()}  # two old shards, both copies
        out = torch.full((6, 2), float("nan"), device="cuda")
        exchange_all([ShardMove(held, out, 6)], 2, {0: 0, 1: 0}, 0, 1, via=torch.device("cpu"))
        assert torch.equal(out.cpu(), whole)
    finally:
        dist.destroy_process_group()
