"""One Kubernetes cluster for the whole e2e session.

By default the devcluster (real kube-apiserver, controller-manager and etcd, with
node agents running pods as local processes) is started in a temporary directory
and stopped after the last e2e test, which fails the session if any process survives
it. Set ELASTICJOB_E2E_KUBECONFIG to run the same tests against another cluster
(``make kind-e2e`` does that with kind); then ``devcluster`` is None.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_faults import E2E_NODES

from elasticjob_devcluster.controlplane import DevCluster

E2E_DIR = Path(__file__).parent

# the session's devcluster while it runs (stop_devcluster takes it out)
_running: list[DevCluster] = []


def stop_devcluster() -> None:
    """Stop the devcluster, if it still runs, and prove that nothing it started survived."""
    while _running:
        cluster = _running.pop()
        cluster.down()
        left = cluster.leftover_processes()
        assert not left, f"processes survived `down`: {left}"


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster | None]:
    if os.environ.get("ELASTICJOB_E2E_KUBECONFIG"):
        yield None
        return
    cluster = DevCluster(tmp_path_factory.mktemp("devcluster"))
    cluster.up(E2E_NODES)
    _running.append(cluster)
    try:
        yield cluster
    finally:
        stop_devcluster()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last e2e test (its module's fixtures already torn down): `make test` runs
    the integration and unit suites next in the same session, and a session fixture would
    keep the cluster idling through them, taking CPU from their timed work."""
    if nextitem is None or E2E_DIR not in nextitem.path.parents:
        stop_devcluster()


@pytest.fixture(scope="session")
def kubeconfig(devcluster: DevCluster | None) -> Path:
    if devcluster is None:
        return Path(os.environ["ELASTICJOB_E2E_KUBECONFIG"])
    return devcluster.kubeconfig
