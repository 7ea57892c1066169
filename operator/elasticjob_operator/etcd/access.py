"""What the operator holds of the shared etcd once it started: where it is, its CA (to
issue the jobs' certificates) and its users. Opened once, at startup; None without one."""

from __future__ import annotations

from dataclasses import dataclass

from elasticjob_operator.etcd.secrets import EtcdSecrets, SecretsNotReady, SharedAuthority
from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.etcd.users import EtcdUsers


@dataclass(frozen=True)
class SharedAccess:
    etcd: SharedEtcd
    authority: SharedAuthority
    users: EtcdUsers


def open_shared(secrets: EtcdSecrets, etcd: SharedEtcd) -> SharedAccess:
    """The shared etcd's Secret made sure of (issued now if it is not there) and its users'
    client; SystemExit when its certificates cannot be had."""
    try:
        authority = secrets.ensure_shared(etcd)
    except SecretsNotReady as exc:
        raise SystemExit(f"the shared etcd's certificates: {exc}") from None
    users = EtcdUsers(
        etcd.endpoint,
        authority.operator_tls,
        authority.root_password,
        secret=f"{etcd.namespace}/{etcd.secret}",
    )
    return SharedAccess(etcd, authority, users)
