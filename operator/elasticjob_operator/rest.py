"""The Kubernetes API as plain JSON: the few calls the operator makes, by path.

The official client's generated API classes cost the operator 29 MiB of its memory
(``CoreV1Api`` alone 21 MiB, measured) and validate every call with pydantic; the
operator keeps the client's configuration, authentication, connection pool and
:class:`ApiException`, and sends and reads dicts by URL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes.client.api_client import ApiClient
from kubernetes.client.exceptions import ApiException

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"

# Every call is bounded. Without it, a connection whose SYN is lost (on kind: sent to the
# API server's Service address while the API server restarted) waits out the kernel's
# two minutes of SYN retries, and one whose answer never comes waits forever, holding a
# reconcile thread. Read: past the API server's own 60 s request timeout.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 70.0


def path(group_version: str, namespace: str, plural: str, name: str | None = None) -> str:
    """The URL path of a namespaced collection (``name`` None) or object; ``v1`` is the
    core group, anything else ``group/version``."""
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{root}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


class Rest:
    def __init__(
        self,
        api: ApiClient | None = None,
        timeouts: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
    ) -> None:
        self.api = api or ApiClient()
        self.timeouts = timeouts  # (connect, read) seconds, for each attempt

    def request(
        self,
        method: str,
        url_path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        """The answer's JSON (None if empty); ApiException for anything but 2xx."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.api.param_serialize(
            method=method,
            resource_path=url_path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(*serialized, _request_timeout=self.timeouts)
        data: bytes = resp.read()  # type: ignore[no-untyped-call]
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=data.decode(), data=None)
        return json.loads(data) if data else None

    def get(self, url_path: str) -> Obj:
        return dict(self.request("GET", url_path))

    def list(self, url_path: str, selector: str | None = None) -> list[Obj]:
        query = {"labelSelector": selector} if selector else None
        return list(self.request("GET", url_path, query)["items"])

    def create(self, url_path: str, obj: Obj) -> Obj:
        return dict(self.request("POST", url_path, body=obj))

    def delete(self, url_path: str, **query: str) -> None:
        self.request("DELETE", url_path, query)

    def patch(self, url_path: str, patch: Obj, content_type: str = MERGE_PATCH) -> None:
        self.request("PATCH", url_path, body=patch, content_type=content_type)
