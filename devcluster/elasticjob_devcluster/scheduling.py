"""Which node a pending pod goes to: the devcluster has no kube-scheduler.

Every agent runs the same pure choice over the same watched objects and binds only the
pods it picks for itself, so pods spread evenly (fewest running pods first, then by
name) and nodes that are NotReady, cordoned, tainted or not matching nodeSelector are
skipped. If views differ for a moment, the API server refuses the second Binding.
A pod left unbound for a few seconds (its chosen node's agent may be stuck) is bound
by any node it fits. binder.py sends the Bindings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

DEFAULT_SCHEDULER = "default-scheduler"


def node_ready(node: Obj) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def tolerates(tolerations: Iterable[Obj], taint: Obj) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def fits(pod: Obj, node: Obj) -> bool:
    spec = pod.get("spec") or {}
    labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    if not node_ready(node):
        return False
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    tolerations = spec.get("tolerations") or []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return False
    return True


def wants_scheduling(pod: Obj) -> bool:
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    return (
        not spec.get("nodeName")
        and (spec.get("schedulerName") or DEFAULT_SCHEDULER) == DEFAULT_SCHEDULER
        and not meta.get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
    )


def choose_node(pod: Obj, nodes: Iterable[Obj], pods: Iterable[Obj]) -> str | None:
    """The node this pod should be bound to, or None when none fits."""
    load: dict[str, int] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            load[node] = load.get(node, 0) + 1
    names = [str(n["metadata"]["name"]) for n in nodes if fits(pod, n)]
    if not names:
        return None
    return min(names, key=lambda n: (load.get(n, 0), n))


def unschedulable_message(pod: Obj, nodes: Iterable[Obj]) -> str:
    """kube-scheduler's style: `0/2 nodes are available: 1 node(s) were not ready, ...`."""
    spec = pod.get("spec") or {}
    counts: dict[str, int] = {}
    total = 0
    for node in nodes:
        total += 1
        labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
        if not node_ready(node):
            why = "node(s) were not ready"
        elif (node.get("spec") or {}).get("unschedulable"):
            why = "node(s) were unschedulable"
        elif any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            why = "node(s) didn't match Pod's node affinity/selector"
        elif not fits(pod, node):
            why = "node(s) had untolerated taint"
        else:
            continue
        counts[why] = counts.get(why, 0) + 1
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
    return f"0/{total} nodes are available: {reasons}."


def leader(nodes: Iterable[Obj]) -> str | None:
    """The first Ready node by name: cluster-wide chores (provisioning volumes, saying
    why a pod is Unschedulable) fall to its agent alone."""
    ready = sorted(str(n["metadata"]["name"]) for n in nodes if node_ready(n))
    return ready[0] if ready else None


@dataclass(frozen=True)
class Decision:
    bind: list[Obj] = field(default_factory=list)
    unschedulable: list[Obj] = field(default_factory=list)  # no node fits, for a while
    first_seen: dict[str, float] = field(default_factory=dict)  # pending pod uid -> when


def decide(
    node: str,
    pods: Iterable[Obj],
    nodes: Iterable[Obj],
    first_seen: Mapping[str, float],
    now: float,
    fallback_s: float,
) -> Decision:
    """What `node` does about the pending pods: bind those the choice gives it, and any
    it fits once a pod has waited `fallback_s`; report those no node fits by then.
    `first_seen` is the previous Decision's (times are monotonic seconds)."""
    all_pods, all_nodes = list(pods), list(nodes)
    me = next((n for n in all_nodes if n["metadata"]["name"] == node), None)
    if me is None:
        return Decision(first_seen=dict(first_seen))
    out = Decision()
    for p in (p for p in all_pods if wants_scheduling(p)):
        first = out.first_seen[p["metadata"]["uid"]] = first_seen.get(p["metadata"]["uid"], now)
        waited = now - first > fallback_s
        choice = choose_node(p, all_nodes, all_pods)
        if choice == node or (waited and fits(p, me)):
            out.bind.append(p)
        elif choice is None and waited:
            out.unschedulable.append(p)
    return out
