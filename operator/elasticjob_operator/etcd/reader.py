"""Read what a run publishes in its etcd: the progress record, the node-memory reports,
the hang records.

The operator's only etcd I/O: the raw bytes, decoded by :mod:`elasticjob_operator.observe`.
Every member of the endpoint list is tried (the rendezvous fails over between them too).
An unreachable store reads as nothing: progress is a nicety and must not stop reconciling.
The job's etcd speaks mutual TLS: the caller passes the client certificate
(:meth:`elasticjob_operator.etcd.secrets.EtcdSecrets.client_credentials`), held in
memory only and never logged.

Three range reads per job and resync need no grpc: they go to etcd's JSON gateway
(:mod:`elasticjob_operator.etcd.gateway`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from elasticjob_operator.etcd.gateway import Gateway, NoMemberAnswered, on_first_member
from elasticjob_runtime import contract
from elasticjob_runtime.etcd.endpoints import TLSCredentials, parse_endpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecords:
    progress: bytes | None = None  # the progress record, if there is one
    memory_fallbacks: tuple[bytes, ...] = ()  # one per pod whose node-memory copy failed
    hangs: tuple[bytes, ...] = ()  # one per round in which the agents detected a hang
    divergences: tuple[bytes, ...] = ()  # one per step at which the ranks disagreed


def read_run_records(
    endpoint: str,
    run_id: str,
    memory_fallbacks: bool = True,
    timeout: float = 1.0,
    tls: TLSCredentials | None = None,
    token: str | None = None,
) -> RunRecords:
    """The records of run ``run_id`` in the etcd at ``endpoint`` (``host:port[,...]``),
    over TLS with ``tls``, as the user of auth ``token`` if given (the shared etcd);
    ``memory_fallbacks=False`` skips the reports (once said, they need no reading)."""
    # Any error reads as nothing, logged at debug: a store that is down or still starting
    # must not fail the round that replaces the job's workers.
    try:
        members = parse_endpoints(endpoint)
    except Exception as exc:
        log.debug("no progress from %r: %s", endpoint, exc)
        return RunRecords()
    try:
        return on_first_member(
            members, tls, timeout, token, lambda g: _read(g, run_id, memory_fallbacks)
        )
    except NoMemberAnswered as exc:
        log.debug("no progress from %s: %s", endpoint, exc)
        return RunRecords()


def _read(gateway: Gateway, run_id: str, memory_fallbacks: bool) -> RunRecords:
    key = contract.progress_key(run_id).encode()
    progress = gateway.range(key).get(key)
    prefix = contract.memory_fallback_prefix(run_id).encode()
    reports = gateway.range(prefix, prefix=True) if memory_fallbacks else {}
    hangs = gateway.range(contract.hang_prefix(run_id).encode(), prefix=True)
    diverged = gateway.range(contract.divergence_prefix(run_id).encode(), prefix=True)
    return RunRecords(
        progress=progress,
        memory_fallbacks=tuple(reports[k] for k in sorted(reports)),
        hangs=tuple(hangs[k] for k in sorted(hangs)),
        divergences=tuple(diverged[k] for k in sorted(diverged)),
    )
