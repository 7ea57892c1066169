"""Kueue beside the devcluster's control plane: the pinned manager (built by
``devcluster/build-kueue.sh``), run as a process like kube-controller-manager.

On a real cluster Kueue runs in a pod; here it runs on the host, so what a pod would
mount is laid out for it instead. Its serving certificate (webhooks, metrics) comes from
the devcluster's CA. The manager reads its metrics certificate from a fixed path,
``/etc/kueue/metrics/certs``, so it starts in a mount namespace of its own whose
``/etc`` is an overlay with that directory: the host's ``/etc`` is never written. No
webhook configuration is registered (the API server never calls Kueue): the ElasticJob
operator writes complete Workloads, and the CRDs' own defaults and CEL rules apply.
Leader election is off (one manager) and the visibility API server is not started.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "devcluster" / "build-kueue.sh"
NAMESPACE = "kueue-system"
NAME = "kueue"  # its process record's name and its log's
METRICS_CERTS = "/etc/kueue/metrics/certs"  # fixed in Kueue's main.go


def build_kueue() -> Path:
    """The directory with the pinned ``kueue`` binary, its ``crds/`` and ``chart/``."""
    out = subprocess.run([str(BUILD_SCRIPT)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def configuration(webhook_port: int, metrics_port: int, health_port: int, cert_dir: Path) -> Any:
    """The manager's ``Configuration`` (config.kueue.x-k8s.io/v1beta2), every port on loopback."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        # an empty list means ["batch/job"]; it acts on Jobs with a queue-name label only
        "integrations": {"frameworks": ["batch/job"]},
    }


def argv(binary: Path, config: Path, kubeconfig: Path, state: Path, cert_dir: Path) -> list[str]:
    """Start the manager in a private mount namespace whose ``/etc`` is an overlay (upper
    layer under ``state``) holding its metrics certificate where it looks for it. ``exec``
    keeps one pid from ``unshare`` to ``kueue``, the pid the cluster records."""
    upper, work = state / "etc-upper", state / "etc-work"
    script = " && ".join(
        [
            f"mkdir -p {shlex.quote(str(upper))} {shlex.quote(str(work))}",
            "mount -t overlay overlay "
            f"-o lowerdir=/etc,upperdir={shlex.quote(str(upper))},workdir={shlex.quote(str(work))}"
            " /etc",
            f"mkdir -p {METRICS_CERTS}",
            f"cp {shlex.quote(str(cert_dir))}/tls.crt {shlex.quote(str(cert_dir))}/tls.key "
            f"{METRICS_CERTS}/",
            "exec "
            + shlex.join(
                [
                    str(binary),
                    f"--config={config}",
                    f"--kubeconfig={kubeconfig}",
                    "--feature-gates=VisibilityOnDemand=false",
                ]
            ),
        ]
    )
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]


def write_configuration(path: Path, config: Any) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
