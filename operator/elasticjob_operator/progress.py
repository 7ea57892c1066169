"""Read the training progress the runtime publishes in the job's etcd.

Tiny functions behind which the etcd client lives, so the operator still runs
(without progress) when the client or the store is not there: the progress record, and
the reports of node-memory checkpoint copies that failed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from elasticjob_runtime import contract

log = logging.getLogger(__name__)


def read_progress(endpoint: str, run_id: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The JSON object at ``contract.progress_key(run_id)``, or None if unavailable."""
    try:
        from elasticjob_runtime import etcd_client
    except ImportError:  # runtime's etcd client not installed: no progress, no error
        return None
    try:
        client = etcd_client.EtcdClient(etcd_client.parse_endpoint(endpoint), timeout=timeout)
        try:
            kv = client.get(contract.progress_key(run_id))
        finally:
            client.close()
    except Exception as exc:  # an unreachable store must not stop reconciling
        log.debug("no progress from %s: %s", endpoint, exc)
        return None
    if kv is None:
        return None
    try:
        data = json.loads(kv.value)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def read_memory_fallbacks(endpoint: str, run_id: str, timeout: float = 1.0) -> list[dict[str, Any]]:
    """The JSON objects under ``contract.memory_fallback_prefix(run_id)`` (one per pod whose
    node-memory checkpoint copy failed), by pod; empty if none or unavailable."""
    try:
        from elasticjob_runtime import etcd_client
    except ImportError:
        return []
    try:
        client = etcd_client.EtcdClient(etcd_client.parse_endpoint(endpoint), timeout=timeout)
        try:
            items = client.snapshot(contract.memory_fallback_prefix(run_id)).items
        finally:
            client.close()
    except Exception as exc:  # an unreachable store must not stop reconciling
        log.debug("no node-memory reports from %s: %s", endpoint, exc)
        return []
    out = []
    for key in sorted(items):
        try:
            data = json.loads(items[key].value)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append(data)
    return out
