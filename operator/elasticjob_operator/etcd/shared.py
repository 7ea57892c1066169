"""One etcd for every job (the chart's ``sharedEtcd.enabled``), each job fenced into its
own keys: the rules, pure.

An etcd pod per job costs a pod start per job; at 50 jobs one shared etcd brought every
pod Running in 150 s against 225-310 s (bench/README.md, "The operator under load"). What
the per-job etcd gave for free is isolation: each job's CA opens only its own etcd. Here
it comes from etcd's own authentication instead. The operator enables it with a root
user only it knows the password of, and gives each job a user and a role of the same
name, ``job-<uid>``, that may read and write only the keys under ``/elasticjob/<uid>``
(every key a run writes is under ``/elasticjob/<run id>/`` and the run id starts with the
uid, :func:`elasticjob_operator.models.run_id`; uids are all 36 characters, so no job's
prefix is a prefix of another's). The job's client certificate names that user (etcd
takes the user from the certificate's common name), so the runtime needs no password and
no change: a worker of job A presenting its certificate is refused every key of job B.

A job uses the shared etcd when the operator has one, the job asked for no endpoint of
its own, and it does not run its own etcd already (a job started before the option was
switched on keeps the etcd it has: its workers know no other).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from elasticjob_operator import models
from elasticjob_operator.network_policy import ENV_NAMESPACE
from elasticjob_runtime import contract

ENV_SERVICE: Final = "ELASTICJOB_SHARED_ETCD_SERVICE"
ENV_SECRET: Final = "ELASTICJOB_SHARED_ETCD_SECRET"
USER_PREFIX: Final = "job-"
ROOT: Final = "root"
# the Secret's key holding the root user's password (beside ca.crt, ca.key, tls.*)
ROOT_PASSWORD_KEY: Final = "root-password"


@dataclass(frozen=True)
class SharedEtcd:
    """Where the chart runs the shared etcd and the Secret holding its certificates."""

    namespace: str
    service: str
    secret: str

    @property
    def endpoint(self) -> str:
        return f"https://{self.service}.{self.namespace}.svc:{contract.DEFAULT_ETCD_PORT}"


def from_env(env: Mapping[str, str]) -> SharedEtcd | None:
    """The chart's shared etcd, or None when it runs none. ValueError naming what to set
    when it is half configured (the chart always sets all three)."""
    service = env.get(ENV_SERVICE, "").strip()
    if not service:
        return None
    secret = env.get(ENV_SECRET, "").strip()
    namespace = env.get(ENV_NAMESPACE, "").strip()
    if not secret or not namespace:
        raise ValueError(
            f"{ENV_SERVICE}={service} asks for the shared etcd: set {ENV_SECRET} to the "
            f"Secret of its certificates and {ENV_NAMESPACE} to the operator's namespace, "
            f"or unset {ENV_SERVICE}"
        )
    return SharedEtcd(namespace=namespace, service=service, secret=secret)


def serves(
    spec: models.ElasticJobSpec, shared: SharedEtcd | None, runs_own_etcd: bool
) -> SharedEtcd | None:
    """The shared etcd if this job's rendezvous goes there, else None (see the module)."""
    if shared is None or not spec.provisions_etcd or runs_own_etcd:
        return None
    return shared


def user_of(uid: str) -> str:
    """The etcd user and role of job ``uid`` (also its client certificate's CN)."""
    return f"{USER_PREFIX}{uid}"


def uid_of(user: str) -> str | None:
    """The job uid behind an etcd user, None for a user that is not a job's (root)."""
    return user[len(USER_PREFIX) :] if user.startswith(USER_PREFIX) else None


def key_prefix(uid: str) -> bytes:
    """The keys job ``uid`` may touch: every run's ``/elasticjob/<uid>[-n]/...``."""
    return f"/elasticjob/{uid}".encode()


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


def stale_users(users: Iterable[str], live_uids: Iterable[str]) -> list[str]:
    """The job users whose job is gone: their DELETED event was missed (the operator was
    down) or their removal failed. Root and users not ours are never touched."""
    live = set(live_uids)
    return sorted(u for u in users if (uid := uid_of(u)) is not None and uid not in live)
