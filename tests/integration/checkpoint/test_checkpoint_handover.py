"""A checkpoint reaches the processes that need it: restarted workers and joining nodes.

* A worker group restarted by the agent reloads from the node-memory copy in
  /dev/shm, even when the disk copy is gone (real ``elasticjob-run`` agent, real etcd).
* A rank whose node-local directory is empty receives the newest checkpoint from a
  peer over the process group, so every rank resumes from the same step.

The test file doubles as the worker: ``python test_checkpoint_handover.py <mode> ...``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
from conftest import EtcdServer, launcher_argv, run_all, run_logged

from elasticjob_runtime.checkpoints.job_identity import directory_name

pytestmark = pytest.mark.integration

BOUND_S = 240.0
MEMORY_ROOT = Path("/dev/shm")


def param_sum(model: object) -> float:
    import torch

    assert isinstance(model, torch.nn.Module)
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def make_model(seed: int) -> object:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))


def agent_worker(out: str) -> None:
    """Under the agent: first incarnation trains 3 steps and crashes; the next reloads."""
    import torch
    import torch.distributed as dist

    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = torch.nn.parallel.DistributedDataParallel(make_model(0))  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CheckpointManager(Path(out) / "ckpt")
    state = {"model": model, "optim": opt}
    resumed = ckpt.restore(state, sync=False)  # node memory is per node; no peer exchange here
    report = {
        "rank": rank,
        "restart": restart,
        "step": None if resumed is None else resumed.step,
        "path": None if resumed is None else str(resumed.path),
        "sum": param_sum(model.module),
    }
    with (Path(out) / "report.jsonl").open("a") as f:
        f.write(json.dumps(report) + "\n")
    if restart > 0:
        dist.destroy_process_group()
        return
    for step in range(1, 4):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(state, step)
    ckpt.close()
    with (Path(out) / "trained.json").open("w") as f:
        json.dump({"sum": param_sum(model.module)}, f)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(out) / "ckpt")  # the disk copy is gone: only node memory is left
    dist.barrier()
    if rank == 1:
        os._exit(1)  # a crashed worker: the agent restarts the whole local group
    dist.barrier()  # rank 0 waits here until the agent stops it


def test_restarted_worker_group_reloads_from_node_memory_without_disk(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    if not MEMORY_ROOT.is_dir():
        pytest.skip("no /dev/shm on this machine")
    run_id = f"handover-{uuid.uuid4().hex[:8]}"
    cmd = launcher_argv(
        etcd.endpoint, run_id, [__file__, "agent", str(tmp_path)], nproc=2, max_restarts=1
    )
    env = {
        **os.environ,
        "ELASTICJOB_POD_NAME": "pod-a",
        "ELASTICJOB_HEALTH_PORT": "0",  # its probes on any free port, not the pod's 8090
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("ELASTICJOB_CHECKPOINT_MEMORY_DIR", None)
    log = tmp_path / "agent.log"
    try:
        code = run_logged(cmd, env, log, BOUND_S)
    finally:
        # keyed by the job: run id and the agent's rendezvous endpoint (checkpoints/job_identity.py)
        memory = MEMORY_ROOT / "elasticjob" / directory_name(f"torchrun/{run_id}@{etcd.endpoint}")
        kept = sorted(p.name for p in memory.rglob("*")) if memory.exists() else []
        shutil.rmtree(memory, ignore_errors=True)
    tail = log.read_text(errors="replace")[-3000:]
    assert code == 0, tail
    reports = [json.loads(line) for line in (tmp_path / "report.jsonl").read_text().splitlines()]
    first = [r for r in reports if r["restart"] == 0]
    again = [r for r in reports if r["restart"] == 1]
    assert len(first) == 2 and all(r["step"] is None for r in first), reports
    assert len(again) == 2, reports
    trained = json.loads((tmp_path / "trained.json").read_text())["sum"]
    for r in again:
        assert r["step"] == 3
        assert r["path"] == str(memory / "pod-a" / "step-0000000003.pt")
        assert r["sum"] == pytest.approx(trained, abs=1e-6)
    assert not (tmp_path / "ckpt").exists()  # nothing on disk: it really came from memory
    assert not kept, kept  # the job succeeded: elasticjob-run removed the memory copy


def peer_worker(workdir: str, rank: int) -> None:
    """One 'node' per rank, each with its own node-local checkpoint directory."""
    import torch.distributed as dist

    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    work = Path(workdir)
    store = dist.FileStore(str(work / "store"), 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = make_model(100 + rank)  # different weights until restored
    ckpt = CheckpointManager(work / f"node{rank}", node_local=True, memory=False)
    resumed = ckpt.restore({"model": model})
    out = {"rank": rank, "step": None if resumed is None else resumed.step, "sum": param_sum(model)}
    (work / f"restored-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_rank_with_empty_node_local_directory_receives_newest_checkpoint(tmp_path: Path) -> None:
    import torch

    from elasticjob_runtime.checkpoints.files import committed_steps
    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    saved = make_model(7)
    assert isinstance(saved, torch.nn.Module)
    node0 = CheckpointManager(tmp_path / "node0", memory=False, writer=True)
    node0.save({"model": saved}, 4)
    node0.save({"model": saved}, 9)
    env = {**os.environ, "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "lo"}
    outs = run_all(
        [[sys.executable, __file__, "peer", str(tmp_path), str(rank)] for rank in (0, 1)],
        env,
        BOUND_S,
    )
    results = [json.loads((tmp_path / f"restored-{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in results] == [9, 9]
    assert all(r["sum"] == pytest.approx(param_sum(saved), abs=1e-6) for r in results)
    assert committed_steps(tmp_path / "node1") == [9]  # the joining node now has it on disk
    assert "received from rank 0" in outs[1]


if __name__ == "__main__":
    if sys.argv[1] == "agent":
        agent_worker(sys.argv[2])
    else:
        peer_worker(sys.argv[2], int(sys.argv[3]))
