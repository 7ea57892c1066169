"""The devcluster's credentials on disk: every private key and every kubeconfig (which
embeds its user's key) is readable by its owner only, from the moment it exists."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml

from elasticjob_devcluster import controlplane
from elasticjob_devcluster.certs import ensure_node_agent_cert, ensure_pki, write_private


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_private_key_is_owner_only(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    ensure_node_agent_cert(pki, "node-1")
    keys = sorted((tmp_path / "pki").glob("*.key"))
    assert len(keys) >= 7
    assert {k.name: mode(k) for k in keys} == {k.name: 0o600 for k in keys}


def test_a_kubeconfig_is_owner_only_even_over_a_readable_file(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    path = tmp_path / "kubeconfig"
    path.write_text("old")
    path.chmod(0o644)
    controlplane.write_kubeconfig(path, "https://127.0.0.1:6443", pki.ca.cert, "admin", pki.admin)
    assert mode(path) == 0o600
    config = yaml.safe_load(path.read_text())
    assert config["users"][0]["user"]["client-key-data"]  # it does hold the key


def test_write_private_never_widens_under_a_permissive_umask(tmp_path: Path) -> None:
    import os

    old = os.umask(0)
    try:
        write_private(tmp_path / "k", b"secret")
    finally:
        os.umask(old)
    assert mode(tmp_path / "k") == 0o600
    assert (tmp_path / "k").read_bytes() == b"secret"


def test_the_api_server_writes_an_audit_log_of_every_request_at_metadata_level(
    tmp_path: Path,
) -> None:
    cfg = controlplane.ClusterConfig(str(tmp_path), "/bin", 1, 2, 3, 4)
    args = controlplane.apiserver_args(cfg, ensure_pki(tmp_path / "pki"))
    assert f"--audit-log-path={tmp_path / 'audit.log'}" in args
    assert f"--audit-policy-file={tmp_path / 'audit-policy.yaml'}" in args
    assert "--audit-log-format=json" in args
    assert controlplane.AUDIT_POLICY["rules"] == [{"level": "Metadata"}]  # never bodies
