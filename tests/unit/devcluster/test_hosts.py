"""Service names resolve through each pod's hosts file."""

from __future__ import annotations

from typing import Any

from elasticjob_devcluster.hosts import hosts_file

REFUSE = "10.244.255.254"


def pod(name: str, ip: str, ns: str = "ml", ready: bool = True, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "x"}},
        "spec": spec,
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def svc(name: str, ns: str = "ml", headless: bool = False, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"app": "x"},
            "clusterIP": "None" if headless else "10.96.0.9",
            **spec,
        },
    }


def lines(text: str) -> dict[str, list[str]]:
    """name -> addresses, in file order."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        ip, *names = line.split()
        for n in names:
            out.setdefault(n, []).append(ip)
    return out


def test_service_names_resolve_in_every_form_to_the_cluster_ip() -> None:
    me = pod("me", "10.244.1.2")
    a = pod("a", "10.244.1.3")
    api = {
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 443}]},
    }
    names = lines(hosts_file(me, [me, a], [svc("store"), api], REFUSE))
    for n in ("store", "store.ml", "store.ml.svc", "store.ml.svc.cluster.local"):
        assert names[n] == ["10.96.0.9"]
    assert names["me"] == ["10.244.1.2"]
    assert names["kubernetes.default.svc"] == ["10.96.0.1"] and "kubernetes" not in names


def test_headless_service_names_resolve_to_ready_backing_pods() -> None:
    me = pod("me", "10.244.1.2")
    a, b = pod("a", "10.244.1.3"), pod("b", "10.244.2.2", ready=False)
    names = lines(hosts_file(me, [me, a, b], [svc("store", headless=True)], REFUSE))
    for n in ("store", "store.ml", "store.ml.svc", "store.ml.svc.cluster.local"):
        assert sorted(names[n]) == ["10.244.1.2", "10.244.1.3"]  # b is not ready


def test_bare_service_name_only_within_its_namespace() -> None:
    me = pod("me", "10.244.1.2", ns="other")
    a = pod("a", "10.244.1.3")
    names = lines(hosts_file(me, [me, a], [svc("store")], REFUSE))
    assert "store" not in names and names["store.ml"] == ["10.96.0.9"]


def test_headless_service_without_ready_pods_does_not_resolve() -> None:
    me = pod("me", "10.244.1.2", ns="other")
    names = lines(hosts_file(me, [me], [svc("gone", headless=True)], REFUSE))
    assert "gone.ml" not in names


def test_headless_service_gives_pod_hostnames_under_the_subdomain() -> None:
    me = pod("me", "10.244.1.2")
    w0 = pod("w0", "10.244.1.7", hostname="worker-0", subdomain="workers")
    names = lines(hosts_file(me, [me, w0], [svc("workers", headless=True)], REFUSE))
    assert names["worker-0.workers.ml.svc.cluster.local"] == ["10.244.1.7"]
    assert names["worker-0.workers"] == ["10.244.1.7"]
    own = lines(hosts_file(w0, [me, w0], [], REFUSE))
    assert own["worker-0"] == ["10.244.1.7"]
    assert own["worker-0.workers.ml.svc.cluster.local"] == ["10.244.1.7"]


def test_publish_not_ready_addresses_and_terminating_pods() -> None:
    me = pod("me", "10.244.1.2")
    slow = pod("slow", "10.244.1.8", ready=False)
    dying = pod("dying", "10.244.1.9")
    dying["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    names = lines(
        hosts_file(
            me, [slow, dying], [svc("all", headless=True, publishNotReadyAddresses=True)], REFUSE
        )
    )
    assert names["all"] == ["10.244.1.8"]
