"""One Kubernetes cluster for the whole e2e session.

By default the devcluster (real kube-apiserver, controller-manager and etcd, with
node agents running pods as local processes) is started in a temporary directory
and stopped at the end, which fails the session if any process survives it.
Set ELASTICJOB_E2E_KUBECONFIG to run the same tests against another cluster
(``make kind-e2e`` does that with kind); then ``devcluster`` is None.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticjob_devcluster.controlplane import DevCluster

E2E_NODES = ("node-1", "node-2")


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster | None]:
    if os.environ.get("ELASTICJOB_E2E_KUBECONFIG"):
        yield None
        return
    cluster = DevCluster(tmp_path_factory.mktemp("devcluster"))
    cluster.up(E2E_NODES)
    try:
        yield cluster
    finally:
        cluster.down()
        left = cluster.leftover_processes()
        assert not left, f"processes survived `down`: {left}"


@pytest.fixture(scope="session")
def kubeconfig(devcluster: DevCluster | None) -> Path:
    if devcluster is None:
        return Path(os.environ["ELASTICJOB_E2E_KUBECONFIG"])
    return devcluster.kubeconfig
