"""ClusterIP Services without kube-proxy: what each pod's service proxy should forward.

Every pod netns routes the whole service CIDR to its own loopback, and the agent
listens there on each Service's clusterIP:port, forwarding each connection to a ready
backing pod's IP:targetPort (named targetPorts are looked up in the pod's container
ports). So clusterIPs, port != targetPort and the `{SVC}_SERVICE_HOST` variables all
work as on a real cluster; a Service with no ready pod has no listener, so a client
gets "connection refused" as kube-proxy's reject rule would give. TCP only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from elasticjob_devcluster.hosts import backends

Obj = dict[str, Any]
Table = dict[tuple[str, int], list[tuple[str, int]]]


def has_cluster_ip(service: Obj) -> bool:
    spec = service.get("spec") or {}
    ip = spec.get("clusterIP")
    return bool(ip) and ip != "None" and spec.get("type") != "ExternalName"


def target_port(pod: Obj, port: Obj) -> int | None:
    """The pod port a Service port sends to (None if a named port is not on the pod)."""
    target = port.get("targetPort") or port["port"]
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def proxy_table(services: Iterable[Obj], pods: Iterable[Obj]) -> Table:
    """(clusterIP, port) -> [(pod IP, target port)] for every TCP port of every Service
    with a selector and a clusterIP that has at least one ready backing pod."""
    all_pods = list(pods)
    table: Table = {}
    for svc in services:
        spec = svc.get("spec") or {}
        if not has_cluster_ip(svc) or not spec.get("selector"):
            continue
        chosen = backends(svc, all_pods)
        for port in spec.get("ports") or []:
            if (port.get("protocol") or "TCP") != "TCP":
                continue
            targets = []
            for p in chosen:
                tp = target_port(p, port)
                if tp is not None:
                    targets.append((str(p["status"]["podIP"]), tp))
            if targets:
                table[(str(spec["clusterIP"]), int(port["port"]))] = targets
    return table


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def service_env(services: Iterable[Obj], namespace: str) -> dict[str, str]:
    """The docker-links style variables kubelet gives for the Services of a namespace
    (enableServiceLinks), e.g. WEB_SERVICE_HOST, WEB_SERVICE_PORT, WEB_PORT_80_TCP."""
    env: dict[str, str] = {}
    for svc in sorted(services, key=lambda s: str((s.get("metadata") or {}).get("name"))):
        meta = svc.get("metadata") or {}
        if meta.get("namespace") != namespace or not has_cluster_ip(svc):
            continue
        spec = svc.get("spec") or {}
        ports = spec.get("ports") or []
        if not ports:
            continue
        ip, name = str(spec["clusterIP"]), _env_name(str(meta.get("name")))
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        first = ports[0]
        env[f"{name}_PORT"] = f"{(first.get('protocol') or 'TCP').lower()}://{ip}:{first['port']}"
        for p in ports:
            proto = (p.get("protocol") or "TCP").upper()
            if p.get("name"):
                env[f"{name}_SERVICE_PORT_{_env_name(p['name'])}"] = str(p["port"])
            key = f"{name}_PORT_{p['port']}_{proto}"
            env[key] = f"{proto.lower()}://{ip}:{p['port']}"
            env[f"{key}_PROTO"] = proto.lower()
            env[f"{key}_PORT"] = str(p["port"])
            env[f"{key}_ADDR"] = ip
    return env
