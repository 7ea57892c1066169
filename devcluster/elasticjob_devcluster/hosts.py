"""A pod's /etc/hosts: how Service names resolve in the devcluster (there is no DNS server).

A Service's names `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local` (and bare `svc`
inside its own namespace) map to its clusterIP, which the agent's per-pod service proxy
answers (services.py). Headless Services map to the IPs of the ready pods they select
(all pods with publishNotReadyAddresses) and also give
`hostname.subdomain.ns.svc[.cluster.local]` for pods that set hostname + subdomain.
`kubernetes.default.svc` is the `kubernetes` Service's clusterIP like any other; the
agents relay it to the API server on the host's loopback.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Obj = dict[str, Any]

CLUSTER_DOMAIN = "cluster.local"


def _meta(o: Obj) -> Obj:
    return o.get("metadata") or {}


def pod_ready(pod: Obj) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def pod_ip(pod: Obj) -> str:
    return str((pod.get("status") or {}).get("podIP") or "")


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def backends(service: Obj, pods: Iterable[Obj]) -> list[Obj]:
    """The pods a Service sends traffic to: selected, with an IP, ready, not terminating."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    ns = _meta(service).get("namespace")
    not_ready_ok = bool(spec.get("publishNotReadyAddresses"))
    out = []
    for p in pods:
        m = _meta(p)
        if m.get("namespace") != ns or m.get("deletionTimestamp"):
            continue
        if not selects(selector, m.get("labels") or {}) or not pod_ip(p):
            continue
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if not_ready_ok or pod_ready(p):
            out.append(p)
    return sorted(out, key=lambda p: str(_meta(p).get("name")))


def service_names(name: str, ns: str, own_ns: str) -> list[str]:
    names = [f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{CLUSTER_DOMAIN}"]
    if ns == own_ns:
        names.insert(0, name)
    return names


def own_names(pod: Obj) -> list[str]:
    spec = pod.get("spec") or {}
    hostname = str(spec.get("hostname") or _meta(pod).get("name"))
    sub = spec.get("subdomain")
    ns = _meta(pod).get("namespace")
    if sub:
        return [f"{hostname}.{sub}.{ns}.svc.{CLUSTER_DOMAIN}", hostname]
    return [hostname]


def hosts_file(pod: Obj, pods: Iterable[Obj], services: Iterable[Obj], refuse_ip: str) -> str:
    """The full /etc/hosts text for `pod`, given every pod and Service in the cluster."""
    all_pods = list(pods)
    own_ns = str(_meta(pod).get("namespace"))
    lines = [
        "# Kubernetes-managed hosts file (elasticjob devcluster node agent).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    if pod_ip(pod):
        lines.append(f"{pod_ip(pod)}\t{' '.join(own_names(pod))}")
    for svc in sorted(services, key=lambda s: (_meta(s).get("namespace"), _meta(s).get("name"))):
        m = _meta(svc)
        spec = svc.get("spec") or {}
        name, ns = str(m.get("name")), str(m.get("namespace"))
        if spec.get("type") == "ExternalName":
            continue
        names = " ".join(service_names(name, ns, own_ns))
        headless = spec.get("clusterIP") == "None"
        if not headless:
            lines.append(f"{spec.get('clusterIP') or refuse_ip}\t{names}")
            continue
        chosen = backends(svc, all_pods)
        lines.extend(f"{pod_ip(p)}\t{names}" for p in chosen)
        for p in chosen:
            pspec = p.get("spec") or {}
            if pspec.get("subdomain") == name and pspec.get("hostname"):
                h = pspec["hostname"]
                pod_names = [f"{h}.{name}.{ns}", f"{h}.{name}.{ns}.svc"]
                pod_names.append(f"{h}.{name}.{ns}.svc.{CLUSTER_DOMAIN}")
                if ns == own_ns:
                    pod_names.insert(0, f"{h}.{name}")
                lines.append(f"{pod_ip(p)}\t{' '.join(pod_names)}")
    return "\n".join(lines) + "\n"
