"""One job never loads another's state, nor bytes that would run code.

* Two jobs under plain torchrun with its default run id ``none``, each on its own etcd,
  share a node-memory root and a pod name: each restarted worker group reloads its own
  node-memory checkpoint, and a checkpoint of the first job planted where the second
  keeps its own is refused (real agents, real etcd).
* A rank that receives the newest checkpoint from a peer over the process group (real
  gloo) refuses bytes that would run code, even when the sending rank opted in.

The test file doubles as the worker: ``python test_checkpoint_isolation.py <mode> ...``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EtcdServer, launcher_argv, run_all, run_logged, start_etcd

from elasticjob_runtime.checkpoints.job_identity import directory_name

pytestmark = pytest.mark.integration

BOUND_S = 240.0
POD = "pod-a"  # both jobs' pods have the same name, as two jobs' worker-0 might


def job_worker(out: str, tag: str, steps: int) -> None:
    """Under the agent: the first incarnation saves ``steps`` steps tagged ``tag``, drops
    the disk copy and crashes; the restarted one reports what it reloads."""
    import torch

    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    work = Path(out)
    ckpt = CheckpointManager(work / "ckpt")
    resumed = ckpt.load_latest()
    report = {
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "step": None if resumed is None else resumed.step,
        "tag": None if resumed is None else resumed.state["tag"],
        "path": None if resumed is None else str(resumed.path),
        "job": ckpt.job,
    }
    with (work / "report.jsonl").open("a") as f:
        f.write(json.dumps(report) + "\n")
    if report["restart"] > 0:
        return
    for step in range(1, steps + 1):
        ckpt.save({"tag": tag, "w": torch.full((4,), float(step))}, step)
    ckpt.close()
    shutil.rmtree(work / "ckpt")  # only node memory is left
    os._exit(1)  # a crashed worker: the agent restarts it


def run_job(etcd: EtcdServer, out: Path, tag: str, steps: int, shm: Path) -> list[dict[str, Any]]:
    """One job (run id ``none``) to its end; its workers' reports and the agent's log."""
    out.mkdir()
    # plain torchrun (elasticjob-run refuses the run id "none"), on the etcd-v3 rendezvous
    cmd = launcher_argv(
        etcd.endpoint,
        "none",
        [__file__, "job", str(out), tag, str(steps)],
        max_restarts=1,
        launcher=[sys.executable, "-m", "torch.distributed.run"],
    )
    env = {
        **os.environ,
        "ELASTICJOB_CHECKPOINT_MEMORY_DIR": str(shm),
        "ELASTICJOB_POD_NAME": POD,
        "ELASTICJOB_HEALTH_PORT": "0",
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("PET_RDZV_ENDPOINT", "PET_RDZV_ID", "ELASTICJOB_JOB_UID"):
        env.pop(name, None)
    log = out / "agent.log"
    code = run_logged(cmd, env, log, BOUND_S)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    reports = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    return [*reports, {"log": text}]


def test_two_jobs_with_run_id_none_never_restore_each_others_node_memory(tmp_path: Path) -> None:
    other = start_etcd("3.5", tmp_path / "etcd-b")
    first = start_etcd("3.5", tmp_path / "etcd-a")  # fresh: run id "none" has no history
    shm = tmp_path / "shm"
    shm.mkdir()
    job_a, job_b = f"torchrun/none@{first.endpoint}", f"torchrun/none@{other.endpoint}"
    memory_a = shm / "elasticjob" / directory_name(job_a) / POD
    memory_b = shm / "elasticjob" / directory_name(job_b) / POD
    try:
        *a, _ = run_job(first, tmp_path / "a", "A", 3, shm)
        # A's newest checkpoint, planted where B keeps its own (a collision, or a hostile file)
        memory_b.mkdir(parents=True)
        for f in memory_a.iterdir():
            shutil.copy(f, memory_b / f.name)
        *b, b_log = run_job(other, tmp_path / "b", "B", 2, shm)
    finally:
        other.stop()
        first.stop()

    assert [(r["restart"], r["step"], r["tag"], r["job"]) for r in a] == [
        (0, None, None, job_a),
        (1, 3, "A", job_a),
    ]
    assert a[1]["path"] == str(memory_a / "step-0000000003.pt")  # from node memory
    # B never saw A's step 3: not when it started, not after its restart (its own step 2)
    assert [(r["restart"], r["step"], r["tag"], r["job"]) for r in b] == [
        (0, None, None, job_b),
        (1, 2, "B", job_b),
    ]
    refused = f"written by another job ({job_a!r}; this is {job_b!r})"
    assert b_log["log"].count(refused) == 2, b_log["log"][-3000:]  # once per incarnation
    assert (memory_b / "step-0000000003.pt").exists()  # refused, and left for a human to see
    assert stat.S_IMODE(memory_a.stat().st_mode) == 0o700
    assert stat.S_IMODE(memory_a.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((shm / "elasticjob").stat().st_mode) == 0o1777


# -- bytes from a peer


def leave_mark(path: str) -> RunsCodeOnLoad:
    """What a hostile checkpoint would run on load: here it leaves a file named by rank.
    What it returns pickles the same way, so the rank that loaded it sends it on as is."""
    Path(f"{path}-rank{os.environ['RANK']}").write_text("code ran")
    return RunsCodeOnLoad(Path(path))


class RunsCodeOnLoad:
    def __init__(self, mark: Path) -> None:
        self.mark = str(mark)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (leave_mark, (self.mark,))


def peer_worker(workdir: str, rank: int) -> None:
    """Rank 0 trusts its own directory (weights_only=False); rank 1, with an empty
    directory, receives rank 0's checkpoint and must not unpickle it."""
    import torch.distributed as dist

    from elasticjob_runtime.checkpoints.format import UnsafeCheckpointError
    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    work = Path(workdir)
    os.environ["RANK"] = str(rank)
    store = dist.FileStore(str(work / "store"), 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    ckpt = CheckpointManager(work / f"node{rank}", node_local=True, memory=False)
    try:
        resumed = ckpt.restore({}, weights_only=rank != 0)
        out = {"step": None if resumed is None else resumed.step, "refused": None}
    except UnsafeCheckpointError as exc:
        out = {"step": None, "refused": str(exc)}
    (work / f"restored-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_bytes_received_from_a_peer_that_would_run_code_are_refused(tmp_path: Path) -> None:
    import torch

    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    mark = tmp_path / "mark"
    node0 = CheckpointManager(tmp_path / "node0", memory=False, writer=True)
    node0.save({"w": torch.ones(3), "evil": RunsCodeOnLoad(mark)}, 6)
    env = {**os.environ, "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "lo"}
    run_all(
        [[sys.executable, __file__, "peer", str(tmp_path), str(rank)] for rank in (0, 1)],
        env,
        BOUND_S,
    )
    trusting, receiving = (json.loads((tmp_path / f"restored-{r}.json").read_text()) for r in "01")
    assert trusting == {"step": 6, "refused": None}
    assert receiving["step"] is None
    assert receiving["refused"].startswith(
        "checkpoint step 6 from rank 0 needs test_checkpoint_isolation.leave_mark"
    )
    assert (tmp_path / "mark-rank0").exists()  # the opt-in really unpickled on rank 0
    assert not (tmp_path / "mark-rank1").exists()  # and nothing ran on the receiving rank
    assert not (tmp_path / "node1").exists()  # nor was anything written there


if __name__ == "__main__":
    if sys.argv[1] == "job":
        job_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        peer_worker(sys.argv[2], int(sys.argv[3]))
