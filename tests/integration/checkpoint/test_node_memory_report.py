"""A checkpoint too big for node memory reaches the job's events once (real etcd, real
tmpfs): each pod's memory writer reports its first failed copy to the run's etcd, the
operator reads the reports and says so in one Warning event per run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import EtcdServer, read_memory_fallbacks

from elasticjob_operator import builders, models, observe
from elasticjob_operator.etcd import reader as etcd_reader
from elasticjob_operator.reconcile import Observed, reconcile
from elasticjob_runtime import contract
from elasticjob_runtime.checkpoints.files import checkpoint_name, committed_steps
from elasticjob_runtime.etcd.client import EtcdClient
from elasticjob_runtime.etcd.endpoints import parse_endpoints

pytestmark = pytest.mark.integration

MiB = 2**20

# A pod's worker: in a mount namespace of its own, /dev/shm is a 1 MiB tmpfs (what the
# operator's emptyDir gives a pod, only smaller); it saves a 2 MiB state twice.
WORKER = textwrap.dedent(
    """
    import ctypes, logging, os, sys
    from pathlib import Path
    import torch
    from elasticjob_devcluster import volumes
    from elasticjob_runtime.checkpoints.manager import CheckpointManager

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(0x00020000) == 0, "unshare(CLONE_NEWNS)"
    assert libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None) == 0  # rec, private
    shm = Path(os.environ["ELASTICJOB_CHECKPOINT_MEMORY_DIR"])
    volumes.mount_tmpfs(shm, 1 << 20, 0o1777)
    mgr = CheckpointManager(sys.argv[1], writer=True, memory_writer=True)
    for step in (1, 2):
        mgr.save({"w": torch.zeros(512 * 1024)}, step)  # 2 MiB of float32
    mgr.close()
    """
)


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs in a mount namespace of its own needs root")


def run_worker(tmp_path: Path, etcd: EtcdServer, run: str, pod: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        contract.RDZV_BACKEND: "etcd-v3",  # as the operator injects it: the endpoint is an etcd
        contract.RDZV_ENDPOINT: etcd.endpoint,
        contract.RDZV_ID: run,
        contract.POD_NAME: pod,
        contract.CHECKPOINT_MEMORY_DIR: str(tmp_path / pod / "shm"),
    }
    (tmp_path / pod / "shm").mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(tmp_path / pod / "ckpt")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.usefixtures("needs_root")
def test_a_checkpoint_too_big_for_node_memory_is_one_warning_event(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    run = f"uid-{uuid.uuid4().hex[:8]}"
    pods = ["train-worker-0", "train-worker-1"]
    workers = [run_worker(tmp_path, etcd, run, pod) for pod in pods]
    outputs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs

    for pod, out in zip(pods, outputs, strict=True):
        # training went on: both saves are on disk, and the worker said it once
        assert committed_steps(tmp_path / pod / "ckpt") == [1, 2]
        [line] = [x for x in out.splitlines() if "node-memory checkpoint copy" in x]
        assert "No space left on device" in line and "on a filesystem of 1 MiB" in line
        assert "raise the ElasticJob's spec.shmSize" in line

    client = EtcdClient(parse_endpoints(etcd.endpoint))
    try:
        reports = read_memory_fallbacks(client, run)
        lease = client.get(contract.memory_fallback_key(run, pods[0]))
    finally:
        client.close()
    assert [r.pod for r in reports] == pods
    size = (tmp_path / pods[0] / "ckpt" / checkpoint_name(1)).stat().st_size
    for r in reports:
        # the first failure only: a second report would have said step 2
        assert (r.step, r.checkpoint_bytes, r.shm_bytes, r.no_space) == (1, size, MiB, True)
    assert lease is not None and lease.lease != 0  # the report goes away by itself

    # the operator's side: what the handler reads, then the pure decision, twice
    raw = etcd_reader.read_run_records(etcd.endpoint, run).memory_fallbacks
    seen = observe.memory_fallbacks_of(raw)
    assert [r.pod for r in seen] == pods
    ref = builders.JobRef(name="train", namespace="ml", uid=run)
    spec = models.ElasticJobSpec.model_validate(
        {
            "shmSize": "1Mi",
            "replicaSpecs": {
                "Worker": {"template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}}
            },
        }
    )
    status = models.ElasticJobStatus()
    said = []
    for _ in range(2):
        d = reconcile(ref, 1, spec, status, Observed(memory_fallbacks=seen), datetime.now(UTC))
        status = d.status
        said += [e for e in d.events if e.reason == "CheckpointNotInNodeMemory"]
    [event] = said
    assert event.type == "Warning"
    assert event.message.startswith(
        f"worker train-worker-0: checkpoint step 1 ({size / MiB:.0f} MiB) does not fit in a "
        "/dev/shm of 1 MiB"
    )
    assert "raise spec.shmSize (1Mi) to at least 256Mi" in event.message
    assert status.node_memory_fallback is not None
    assert status.node_memory_fallback.run_id == run
