"""Binds the pending pods this node picks (the devcluster has no kube-scheduler).

scheduling.py decides; this sends the Bindings and, as kube-scheduler does, says why
a pod no node fits stays Pending (PodScheduled=False and a FailedScheduling event,
posted once, by the leader node only). Nothing is written while the node is cut off.
"""

from __future__ import annotations

import logging
import time

from elasticjob_devcluster import scheduling
from elasticjob_devcluster.events import SCHEDULER
from elasticjob_devcluster.kubeapi import TIMEOUT, ApiException, Obj, body
from elasticjob_devcluster.node_context import NodeContext
from elasticjob_devcluster.pod_status import rfc3339

log = logging.getLogger("elasticjob_devcluster.binder")

UNBOUND_FALLBACK_S = 3.0


class Binder:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.first_seen: dict[str, float] = {}  # pending pod uid -> monotonic time

    def schedule(self, pods: list[Obj], nodes: list[Obj]) -> None:
        if not self.ctx.link.up:
            return
        now = time.monotonic()
        d = scheduling.decide(self.ctx.node, pods, nodes, self.first_seen, now, UNBOUND_FALLBACK_S)
        self.first_seen = d.first_seen
        for pod in d.bind:
            self.bind(pod)
        if d.unschedulable and scheduling.leader(nodes) == self.ctx.node:
            for pod in d.unschedulable:
                self.report_unschedulable(pod, nodes)

    def bind(self, pod: Obj) -> None:
        m = pod["metadata"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.ctx.node},
        }
        try:
            self.ctx.core.create_namespaced_pod_binding(
                m["name"],
                m["namespace"],
                body(binding),
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
            log.info("bound %s/%s", m["namespace"], m["name"])
            msg = f"Successfully assigned {m['namespace']}/{m['name']} to {self.ctx.node}"
            self.ctx.events.event(pod, "Normal", "Scheduled", msg, SCHEDULER)
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("binding %s/%s: %s", m["namespace"], m["name"], e.reason)

    def report_unschedulable(self, pod: Obj, nodes: list[Obj]) -> None:
        """PodScheduled=False/Unschedulable, as kube-scheduler says it, so `kubectl
        describe` explains a pod stuck Pending; once (the condition stays)."""
        conds = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conds):
            return
        m = pod["metadata"]
        message = scheduling.unschedulable_message(pod, nodes)
        cond = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": rfc3339(time.time()),
            "lastProbeTime": None,
        }
        try:
            self.ctx.core.patch_namespaced_pod_status(
                m["name"],
                m["namespace"],
                {"status": {"conditions": [cond]}},
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )  # strategic merge: conditions merge by type
            self.ctx.events.event(pod, "Warning", "FailedScheduling", message, SCHEDULER)
        except ApiException as e:
            log.warning("unschedulable %s/%s: %s", m["namespace"], m["name"], e.reason)
