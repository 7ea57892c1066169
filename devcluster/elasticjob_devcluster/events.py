"""Kubelet-style core/v1 Events about pods: what `kubectl describe pod` lists.

Best effort, as in kubelet: whoever notices something queues an event and one thread
posts them, so a slow API server never stalls the reconcile loop, and nothing is
written while the node is cut off from the API server.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from elasticjob_devcluster.kubeapi import TIMEOUT, Obj, body
from elasticjob_devcluster.pod_status import rfc3339

if TYPE_CHECKING:
    from elasticjob_devcluster.node_context import Link

KUBELET = "kubelet"
SCHEDULER = "default-scheduler"


def event_body(
    pod: Obj, node: str, etype: str, reason: str, message: str, component: str, now: float
) -> Obj:
    m = pod["metadata"]
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{m['name']}.", "namespace": m["namespace"]},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": m["name"],
            "namespace": m["namespace"],
            "uid": m["uid"],
        },
        "reason": reason,
        "message": message,
        "type": etype,
        "source": {"component": component, "host": node},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "reportingComponent": component,
        "reportingInstance": node,
    }


class EventRecorder:
    def __init__(self, core: Any, node: str, link: Link) -> None:
        self.core = core
        self.node = node
        self.link = link
        self.queue: queue.Queue[Obj] = queue.Queue()

    def event(
        self, pod: Obj, etype: str, reason: str, message: str, component: str = KUBELET
    ) -> None:
        """Queue an Event about `pod` (dropped while the node is cut off)."""
        if self.link.up:
            ev = event_body(pod, self.node, etype, reason, message, component, time.time())
            self.queue.put(ev)

    def post_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                ev = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            with contextlib.suppress(Exception):  # an event is best effort, as in kubelet
                self.core.create_namespaced_event(
                    ev["metadata"]["namespace"],
                    body(ev),
                    _preload_content=False,
                    _request_timeout=TIMEOUT,
                )
