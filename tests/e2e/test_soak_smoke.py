"""The soak harness (bench/soak.py, `make soak`) in small, so its code cannot rot: two
jobs on the session's cluster, a couple of faults, and the same end checks as the soak
(Succeeded, every step trained, no sample lost or repeated within an epoch)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kube_helpers import RUNTIME_IMAGE, Cluster, installed_operator

from bench.soak import FaultKind, Soak, SoakConfig, operator_nodes, table
from elasticjob_devcluster.controlplane import DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SEED = 20261123


def test_the_soak_harness_runs_two_jobs_through_faults_and_audits_them(
    kubeconfig: Path, devcluster: DevCluster | None
) -> None:
    kinds = (FaultKind.KILL_WORKER, FaultKind.DELETE_POD)
    if devcluster is None:
        kinds = (FaultKind.DELETE_POD, FaultKind.SCALE)
    cfg = SoakConfig(
        seed=SEED,
        jobs=2,
        minutes=2.0,
        drain_minutes=4.0,
        concurrency=2,
        steps=100,
        fault_gap=(3.0, 6.0),
        max_faults=2,
        node_losses=0,
        kinds=kinds,
        image=RUNTIME_IMAGE,  # the example names a published image: there is none yet
    )
    c = Cluster(kubeconfig)
    with installed_operator(c, "sk") as op:
        soak = Soak(kubeconfig, op.job_namespace, cfg, devcluster)
        records = soak.run(operator_nodes(c.core, op.namespace))
        print(table(records))
    assert soak.faults == 2, "the smoke injected fewer faults than asked: it proved little"
    assert [r.name for r in records] == ["soak-00", "soak-01"]
    for r in records:
        assert not r.problems, table(records)
        assert r.phase == "Succeeded" and r.steps == cfg.steps
