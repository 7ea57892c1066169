"""Kueue beside the devcluster: its configuration keeps every port on loopback and needs
no cluster-side certificates, and its start never writes the host's /etc."""

from __future__ import annotations

import shlex
from pathlib import Path

from elasticjob_devcluster import kueue


def test_the_manager_listens_on_loopback_only_and_needs_no_in_cluster_setup() -> None:
    config = kueue.configuration(9443, 8443, 8081, Path("/c/certs"))
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": "/c/certs"}
    assert config["metrics"]["bindAddress"] == "127.0.0.1:8443"
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"
    # out of a cluster: no Lease namespace to elect in, no Secret to rotate certificates in
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {"enable": False}


def test_its_metrics_certificate_goes_to_an_overlay_of_etc_in_its_own_mount_namespace() -> None:
    argv = kueue.argv(
        Path("/bin/kueue"),
        Path("/c/config.yaml"),
        Path("/c/kubeconfig"),
        Path("/c/state"),
        Path("/c/certs"),
    )
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    script = argv[-1]
    steps = script.split(" && ")
    overlay = shlex.split(steps[1])
    assert overlay[:4] == ["mount", "-t", "overlay", "overlay"]
    assert "upperdir=/c/state/etc-upper" in overlay[5] and overlay[-1] == "/etc"
    assert steps[2] == f"mkdir -p {kueue.METRICS_CERTS}"  # after the overlay: never the host's
    assert shlex.split(steps[-1])[:2] == ["exec", "/bin/kueue"]  # one pid, the recorded one
    assert "--feature-gates=VisibilityOnDemand=false" in script
