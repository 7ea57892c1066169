"""ClusterIP Services: the proxy table and the service environment variables."""

from __future__ import annotations

from typing import Any

from elasticjob_devcluster.services import proxy_table, service_env


def pod(name: str, ip: str, ready: bool = True, ports: list[Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ml", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "c", "ports": ports or []}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def svc(name: str, ports: list[Any], cluster_ip: str = "10.96.0.20") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"selector": {"app": "web"}, "clusterIP": cluster_ip, "ports": ports},
    }


def test_ports_map_to_ready_pods_target_ports_by_number_or_name() -> None:
    http = [{"name": "http", "containerPort": 8080}]
    pods = [pod("a", "10.244.1.2", ports=http), pod("b", "10.244.1.3", ready=False, ports=http)]
    ports = [
        {"name": "web", "port": 80, "targetPort": "http"},
        {"name": "admin", "port": 81, "targetPort": 9000},
        {"name": "same", "port": 82},
        {"name": "dns", "port": 53, "protocol": "UDP"},
    ]
    table = proxy_table([svc("web", ports)], pods)
    assert table == {
        ("10.96.0.20", 80): [("10.244.1.2", 8080)],
        ("10.96.0.20", 81): [("10.244.1.2", 9000)],
        ("10.96.0.20", 82): [("10.244.1.2", 82)],
    }


def test_services_without_ready_pods_or_cluster_ip_have_no_entry() -> None:
    assert proxy_table([svc("web", [{"port": 80}])], [pod("a", "10.244.1.2", ready=False)]) == {}
    assert proxy_table([svc("web", [{"port": 80}], cluster_ip="None")], [pod("a", "1.2.3.4")]) == {}


def test_service_links_environment_like_kubelet() -> None:
    ports = [{"name": "http", "port": 80, "protocol": "TCP"}, {"port": 443}]
    env = service_env([svc("my-web", ports)], "ml")
    assert env["MY_WEB_SERVICE_HOST"] == "10.96.0.20"
    assert env["MY_WEB_SERVICE_PORT"] == "80"
    assert env["MY_WEB_SERVICE_PORT_HTTP"] == "80"
    assert env["MY_WEB_PORT"] == "tcp://10.96.0.20:80"
    assert env["MY_WEB_PORT_443_TCP_ADDR"] == "10.96.0.20"
    assert service_env([svc("my-web", ports)], "other") == {}
