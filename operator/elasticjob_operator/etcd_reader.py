"""Read what a run publishes in its etcd: the progress record, the node-memory reports,
the hang records.

The operator's only etcd I/O: the raw bytes, decoded by :mod:`elasticjob_operator.observe`.
Every member of the endpoint list is tried (the rendezvous fails over between them too).
An unreachable store reads as nothing: progress is a nicety and must not stop reconciling.
The job's etcd speaks mutual TLS: the caller passes the client certificate
(:meth:`elasticjob_operator.etcd_secrets.EtcdSecrets.client_credentials`), held in
memory only and never logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from elasticjob_runtime import contract
from elasticjob_runtime.etcd_client import EtcdClient, EtcdError, TLSCredentials, parse_endpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecords:
    progress: bytes | None = None  # the progress record, if there is one
    memory_fallbacks: tuple[bytes, ...] = ()  # one per pod whose node-memory copy failed
    hangs: tuple[bytes, ...] = ()  # one per round in which the agents detected a hang


def read_run_records(
    endpoint: str,
    run_id: str,
    memory_fallbacks: bool = True,
    timeout: float = 1.0,
    tls: TLSCredentials | None = None,
) -> RunRecords:
    """The records of run ``run_id`` in the etcd at ``endpoint`` (``host:port[,...]``),
    over TLS with ``tls``; ``memory_fallbacks=False`` skips the reports (once said, they
    need no reading)."""
    # Any error reads as nothing, logged at debug: a store that is down or still starting
    # must not fail the round that replaces the job's workers.
    try:
        members = parse_endpoints(endpoint)
        client = EtcdClient(members, timeout=timeout, tls=tls)
    except Exception as exc:
        log.debug("no progress from %r: %s", endpoint, exc)
        return RunRecords()
    try:
        # A request to a member that does not answer fails, and the client sets that member
        # aside: the next attempt goes to the next one.
        for _ in members:
            try:
                return _read(client, run_id, memory_fallbacks)
            except EtcdError as exc:
                error: Exception = exc
    except Exception as exc:
        error = exc
    finally:
        client.close()
    log.debug("no progress from %s: %s", endpoint, error)
    return RunRecords()


def _read(client: EtcdClient, run_id: str, memory_fallbacks: bool) -> RunRecords:
    kv = client.get(contract.progress_key(run_id))
    prefix = contract.memory_fallback_prefix(run_id)
    reports = client.snapshot(prefix).items if memory_fallbacks else {}
    hangs = client.snapshot(contract.hang_prefix(run_id)).items
    return RunRecords(
        progress=kv.value if kv is not None else None,
        memory_fallbacks=tuple(reports[key].value for key in sorted(reports)),
        hangs=tuple(hangs[key].value for key in sorted(hangs)),
    )
