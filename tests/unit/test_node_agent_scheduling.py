"""Pending pods go to the least loaded node that fits, as every agent computes alike."""

from __future__ import annotations

from typing import Any

from elasticjob_devcluster.scheduling import (
    choose_node,
    tolerates,
    unschedulable_message,
    wants_scheduling,
)


def node(name: str, ready: bool = True, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pod(node_name: str = "", phase: str = "Pending", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p"},
        "spec": {"nodeName": node_name, **spec},
        "status": {"phase": phase},
    }


def test_least_loaded_ready_node_wins_and_ties_break_by_name() -> None:
    nodes = [node("a"), node("b"), node("c", ready=False)]
    assert choose_node(pod(), nodes, []) == "a"
    assert choose_node(pod(), nodes, [pod("a", "Running")]) == "b"
    assert choose_node(pod(), nodes, [pod("a", "Succeeded")]) == "a"


def test_node_selector_cordon_and_taints_are_respected() -> None:
    nodes = [node("a", unschedulable=True), node("b"), node("c")]
    assert choose_node(pod(nodeSelector={"kubernetes.io/hostname": "c"}), nodes, []) == "c"
    assert choose_node(pod(nodeSelector={"kubernetes.io/hostname": "a"}), nodes, []) is None
    taint = {"key": "gpu", "value": "yes", "effect": "NoSchedule"}
    tainted = [node("a", taints=[taint])]
    assert choose_node(pod(), tainted, []) is None
    tol = [{"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}]
    assert choose_node(pod(tolerations=tol), tainted, []) == "a"


def test_toleration_operators() -> None:
    taint = {"key": "k", "value": "v", "effect": "NoExecute"}
    assert tolerates([{"operator": "Exists"}], taint)
    assert tolerates([{"key": "k", "operator": "Exists"}], taint)
    assert not tolerates([{"key": "k", "value": "w"}], taint)
    assert not tolerates([{"key": "k", "operator": "Exists", "effect": "NoSchedule"}], taint)


def test_only_unbound_pending_default_scheduler_pods_are_scheduled() -> None:
    assert wants_scheduling(pod())
    assert not wants_scheduling(pod("a"))
    assert not wants_scheduling(pod(schedulerName="volcano"))


def test_unschedulable_message_counts_reasons_like_kube_scheduler() -> None:
    nodes = [node("a", ready=False), node("b"), node("c")]
    msg = unschedulable_message(pod(nodeSelector={"disk": "ssd"}), nodes)
    assert msg == (
        "0/3 nodes are available: 2 node(s) didn't match Pod's node affinity/selector, "
        "1 node(s) were not ready."
    )
