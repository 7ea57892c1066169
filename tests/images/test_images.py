"""The Dockerfile's two images, run as a user runs them.

* the operator image: no torch, small, non-root; started with a kubeconfig against a real
  API server (the devcluster's), it reconciles an ElasticJob;
* the runtime image: two containers and an etcd container on a Docker bridge train the
  example to completion as a non-root user, one is killed with ``docker kill`` and the
  other trains on alone, and the killed one, started again, rejoins.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import OPERATOR, RUNTIME, Docker

from elasticjob_devcluster.controlplane import DevCluster

pytestmark = [pytest.mark.images, pytest.mark.timeout(1800)]

T = TypeVar("T")
STEPS = 600  # about a minute at TRAIN_SLEEP=0.1: time to kill one and start it again


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 300) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_the_operator_image_has_no_torch_and_runs_as_non_root(docker: Docker) -> None:
    probe = (
        "import importlib.util, os, json; "
        "print(json.dumps([os.getuid(), importlib.util.find_spec('torch') is None, "
        "importlib.util.find_spec('grpc') is None]))"
    )
    out = docker("run", "--rm", "--entrypoint", "python", OPERATOR, "-c", probe)
    assert json.loads(out) == [65532, True, True]
    size = int(docker("image", "inspect", "--format", "{{.Size}}", OPERATOR))
    assert size < 400 * 2**20, f"the operator image is {size / 2**20:.0f} MiB"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[DevCluster]:
    dev = DevCluster(tmp_path / "devcluster")
    dev.up(["node-1"])
    try:
        yield dev
    finally:
        dev.down()


def test_the_operator_image_reconciles_a_job(
    docker: Docker, cluster: DevCluster, tmp_path: Path
) -> None:
    def kubectl(*args: str, input: str | None = None) -> str:
        out = subprocess.run(
            ["kubectl", f"--kubeconfig={cluster.kubeconfig}", *args],
            input=input, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    kubectl("apply", "-f", str(Path(__file__).parents[2] / "crds" / "elasticjob.yaml"))
    kubectl("create", "namespace", "img")
    # readable by the image's user (the devcluster writes it 0600 for root)
    config = tmp_path / "kubeconfig"
    config.write_text(cluster.kubeconfig.read_text())
    config.chmod(0o644)
    operator = docker.run(
        "--network", "host",  # the devcluster's API server listens on this host's loopback
        "-v", f"{config}:/kube/config:ro",
        "-e", "KUBECONFIG=/kube/config",
        "-e", "ELASTICJOB_NAMESPACES=img",
        "-e", "ELASTICJOB_NETWORK_POLICY=false",
        "-e", "ELASTICJOB_METRICS_PORT=0",
        OPERATOR, "--namespace=img",
    )  # fmt: skip
    job = {
        "apiVersion": "elastic.pytorch.org/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "img", "namespace": "img"},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 2,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "t", "image": RUNTIME, "command": ["sleep", "600"]}
                            ]
                        }
                    },
                }
            },
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(job))

    def reconciled() -> bool:
        pods = kubectl("-n", "img", "get", "pods", "-o", "name")
        status = kubectl("-n", "img", "get", "elasticjob", "img", "-o", "jsonpath={.status}")
        return "img-worker-1" in pods and "Created" in status

    try:
        wait_for("the operator in its image to create the job's workers", reconciled, 90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{_logs(docker, operator)[-3000:]}") from None


def _logs(docker: Docker, cid: str) -> str:
    return docker.logs(cid)


def test_runtime_containers_train_survive_a_docker_kill_and_rejoin(
    docker: Docker, etcd_image: str
) -> None:
    net = f"elasticjob-test-{uuid.uuid4().hex[:8]}"
    docker.network(net)
    docker.run(
        "--network", net, "--name", f"{net}-etcd", "--hostname", "etcd", "--network-alias", "etcd",
        etcd_image, "--data-dir=/tmp/etcd",
        "--listen-client-urls=http://0.0.0.0:2379", "--advertise-client-urls=http://etcd:2379",
        "--heartbeat-interval=100", "--election-timeout=600",
    )  # fmt: skip
    workers: dict[str, str] = {}
    for i in (0, 1):
        name = f"{net}-w{i}"
        workers[name] = docker.run(
            "--network", net, "--name", name, "--hostname", name,
            "-e", f"TRAIN_STEPS={STEPS}", "-e", "TRAIN_EPOCHS=1000", "-e", "TRAIN_SLEEP=0.1",
            "-e", "TRAIN_LOG_EVERY=10",
            "-e", "TRAIN_CHECKPOINT_INTERVAL=20", "-e", "TRAIN_LOG_RANKS=all",
            "-e", "GLOO_SOCKET_IFNAME=eth0",
            RUNTIME, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=etcd-v3",
            "--rdzv-endpoint=etcd:2379", f"--rdzv-id={net}", "--max-restarts=3",
            "-m", "elasticjob_examples.train_regression",
        )  # fmt: skip
    (w0, c0), (w1, c1) = workers.items()

    def steps(cid: str, world: int) -> list[int]:
        return [
            int(m.group(1))
            for m in re.finditer(rf"step=(\d+) .*world={world}\b", _logs(docker, cid))
        ]

    def logged(what: str, check: Callable[[], T | None], timeout: float = 300) -> T:
        try:
            return wait_for(what, check, timeout)
        except AssertionError as exc:
            tails = "\n".join(f"--- {n}:\n{_logs(docker, c)[-2000:]}" for n, c in workers.items())
            raise AssertionError(f"{exc}\n{tails}") from None

    logged("both training at world 2", lambda: steps(c0, 2) and steps(c1, 2))
    assert docker("exec", c0, "id", "-u").strip() == "65532"
    docker("kill", c1)
    killed_at = max(steps(c0, 2))
    logged("w0 training alone", lambda: [s for s in steps(c0, 1) if s > killed_at])
    docker("start", c1)
    rejoined = logged(
        "w1 back and both at world 2", lambda: [s for s in steps(c0, 2) if s > killed_at]
    )
    assert rejoined

    def exited_0(cid: str) -> bool:
        state = docker("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", cid)
        return state.split() == ["exited", "0"]

    for cid in (c0, c1):
        logged("the run to finish", lambda cid=cid: exited_0(cid), 600)
    results = [
        json.loads(line.split(" ", 1)[1])
        for cid in (c0, c1)
        for line in _logs(docker, cid).splitlines()
        if line.startswith("ELASTICJOB_RESULT ")
    ]
    assert results and results[-1]["steps"] == STEPS, (w0, w1, results)
