"""Pending pods go to the least loaded node that fits, as every agent computes alike."""

from __future__ import annotations

from typing import Any

from elasticjob_devcluster.scheduling import (
    choose_node,
    decide,
    leader,
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


def pending(uid: str, **spec: Any) -> dict[str, Any]:
    p = pod(**spec)
    p["metadata"] = {"name": uid, "uid": uid}
    return p


def test_the_leader_is_the_first_ready_node_by_name() -> None:
    assert leader([node("b"), node("a", ready=False), node("c")]) == "b"
    assert leader([node("a", ready=False)]) is None


def test_a_node_binds_the_pods_it_is_chosen_for_and_remembers_when_it_saw_them() -> None:
    nodes = [node("a"), node("b")]
    first = pending("p1")
    d = decide("b", [first], nodes, {}, now=10.0, fallback_s=3.0)
    assert d.bind == [] and d.first_seen == {"p1": 10.0}  # "a" is chosen
    d = decide("a", [first], nodes, {}, now=10.0, fallback_s=3.0)
    assert d.bind == [first]


def test_a_pod_left_unbound_is_bound_by_any_node_it_fits_after_the_fallback() -> None:
    nodes = [node("a"), node("b")]
    p = pending("p1")
    assert decide("b", [p], nodes, {"p1": 10.0}, now=12.0, fallback_s=3.0).bind == []
    assert decide("b", [p], nodes, {"p1": 10.0}, now=13.5, fallback_s=3.0).bind == [p]


def test_a_pod_no_node_fits_is_reported_after_the_fallback_and_forgotten_once_bound() -> None:
    nodes = [node("a")]
    p = pending("p1", nodeSelector={"disk": "ssd"})
    assert decide("a", [p], nodes, {}, now=10.0, fallback_s=3.0).unschedulable == []
    d = decide("a", [p], nodes, {"p1": 10.0}, now=14.0, fallback_s=3.0)
    assert d.unschedulable == [p] and d.bind == []
    bound = pending("p1", nodeName="a")
    assert decide("a", [bound], nodes, d.first_seen, now=15.0, fallback_s=3.0).first_seen == {}


def test_a_node_not_yet_registered_decides_nothing() -> None:
    d = decide("z", [pending("p1")], [node("a")], {"p1": 1.0}, now=10.0, fallback_s=3.0)
    assert (d.bind, d.unschedulable, d.first_seen) == ([], [], {"p1": 1.0})
