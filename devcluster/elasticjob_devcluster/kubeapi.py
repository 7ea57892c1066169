"""The node agent's seam to the Kubernetes client: raw JSON in and out.

The agent keeps API objects as the JSON dicts the watches stream (what kubelet's own
code would read and write), so it asks the client for raw responses and hands it
dicts where its typed signatures want models (it sends dicts as they are).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch

Obj = dict[str, Any]
ApiException = client.ApiException
TIMEOUT = 15  # seconds, on every request
MERGE_PATCH = "application/merge-patch+json"  # lists (podIPs, conditions) replace, not merge

# the client's helpers are untyped; these are their real shapes
new_client: Callable[..., Any] = config.new_client_from_config
Watch: Callable[[], Any] = watch.Watch


def body(obj: Obj) -> Any:
    """A plain JSON body where the typed client expects a model."""
    return obj


def raw(resp: Any) -> Obj:
    """The JSON of a response asked for with `_preload_content=False`."""
    data: Obj = json.loads(resp.data)
    return data


def key(obj: Obj) -> str:
    """namespace/name (just /name for cluster-scoped objects)."""
    m = obj.get("metadata") or {}
    return f"{m.get('namespace', '')}/{m.get('name')}"
