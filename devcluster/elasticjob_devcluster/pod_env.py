"""A container's environment, resolved from the pod the way kubelet resolves it.

Pure: the caller fetches the ConfigMaps and Secrets the pod refers to (see
`referenced_objects`) and passes them in, so the rules are testable without a cluster.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils import quantity

from elasticjob_devcluster.container_images import Image

# the client's helper is untyped; this is its real signature
parse_quantity: Callable[[str], Decimal] = quantity.parse_quantity

Obj = dict[str, Any]

_VALID_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class EnvError(Exception):
    """The pod refers to something missing; kubelet reports CreateContainerConfigError."""


@dataclass(frozen=True)
class PodContext:
    """What the agent knows about a pod beyond its manifest."""

    pod_ip: str
    host_ip: str
    node_allocatable: Mapping[str, str]


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubelet's $(VAR) expansion: defined names expand, `$$` escapes, the rest stay as-is."""
    out: list[str] = []
    i = 0
    n = len(value)
    while i < n:
        c = value[i]
        if c == "$" and i + 1 < n:
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = value.find(")", i + 2)
                if close != -1:
                    name = value[i + 2 : close]
                    if name in env:
                        out.append(env[name])
                    else:
                        out.append(value[i : close + 1])
                    i = close + 1
                    continue
        out.append(c)
        i += 1
    return "".join(out)


def field_value(pod: Obj, path: str, ctx: PodContext) -> str:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
    }
    if path not in simple:
        raise EnvError(f"unsupported fieldRef fieldPath {path!r}")
    return str(simple[path] or "")


def _resource_value(container: Obj, ref: Obj, ctx: PodContext) -> str:
    resource = str(ref.get("resource", ""))
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise EnvError(f"unsupported resourceFieldRef resource {resource!r}")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(name)
    if raw is None and kind == "limits":
        raw = ctx.node_allocatable.get(name)
    if raw is None:
        raw = "0"
    divisor = parse_quantity(str(ref.get("divisor") or "1"))
    value: Decimal = parse_quantity(str(raw)) / divisor
    return str(math.ceil(value))


def _lookup(objs: Mapping[str, Obj], kind: str, name: str, key: str, optional: bool) -> str | None:
    obj = objs.get(name)
    if obj is None:
        if optional:
            return None
        raise EnvError(f'{kind} "{name}" not found')
    data = dict(obj.get("data") or {})
    if kind == "secret":
        data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
    if key not in data:
        if optional:
            return None
        raise EnvError(f"couldn't find key {key} in {kind.capitalize()} {obj_ns(obj)}/{name}")
    return str(data[key])


def obj_ns(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("namespace", ""))


def pod_hostname(pod: Obj) -> str:
    """spec.hostname or the pod name, cut to 63 characters as kubelet does."""
    spec = pod.get("spec") or {}
    if spec.get("hostNetwork") and spec.get("nodeName"):
        return str(spec["nodeName"])  # the node's name, as a host-network pod sees it
    name = str(spec.get("hostname") or pod["metadata"]["name"])
    return name[:63].rstrip("-.") or name[:63]


def runtime_env(
    pod: Obj,
    service_env: Mapping[str, str],
    path: str,
    home: str,
    kube_ip: str,
    host_ip: str,
    apiserver_port: int,
) -> dict[str, str]:
    """What kubelet sets before the container's own env: the Services' variables (unless
    enableServiceLinks is false), PATH, HOSTNAME, HOME and where the API server is: the
    `kubernetes` Service's clusterIP, or for hostNetwork pods (no clusterIPs out there)
    the API server itself on the node."""
    spec = pod.get("spec") or {}
    env = dict(service_env) if spec.get("enableServiceLinks", True) else {}
    env |= {
        "PATH": path,
        "HOSTNAME": pod_hostname(pod),
        "HOME": home,
        "KUBERNETES_SERVICE_HOST": kube_ip,
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "443",
        "KUBERNETES_PORT": f"tcp://{kube_ip}:443",
        "KUBERNETES_PORT_443_TCP": f"tcp://{kube_ip}:443",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_PORT": "443",
        "KUBERNETES_PORT_443_TCP_ADDR": kube_ip,
    }
    if spec.get("hostNetwork"):
        port = str(apiserver_port)
        env |= {
            "KUBERNETES_SERVICE_HOST": host_ip,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host_ip}:{port}",
        }
    return env


def resolve_env(
    pod: Obj,
    container: Obj,
    ctx: PodContext,
    configmaps: Mapping[str, Obj],
    secrets: Mapping[str, Obj],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one container: `base`, then envFrom, then env (later wins)."""
    env: dict[str, str] = dict(base or {})
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        if "configMapRef" in source and source["configMapRef"] is not None:
            ref, objs, kind = source["configMapRef"], configmaps, "configmap"
        elif "secretRef" in source and source["secretRef"] is not None:
            ref, objs, kind = source["secretRef"], secrets, "secret"
        else:
            continue
        obj = objs.get(ref.get("name", ""))
        if obj is None:
            if ref.get("optional"):
                continue
            raise EnvError(f'{kind} "{ref.get("name")}" not found')
        data = dict(obj.get("data") or {})
        if kind == "secret":
            data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        for k, v in data.items():
            if _VALID_ENV_NAME.match(prefix + k):
                env[prefix + k] = str(v)
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" in var and var["valueFrom"] is not None:
            vf = var["valueFrom"]
            value: str | None
            if vf.get("fieldRef"):
                value = field_value(pod, vf["fieldRef"]["fieldPath"], ctx)
            elif vf.get("resourceFieldRef"):
                value = _resource_value(container, vf["resourceFieldRef"], ctx)
            elif vf.get("configMapKeyRef"):
                r = vf["configMapKeyRef"]
                value = _lookup(
                    configmaps, "configmap", r["name"], r["key"], bool(r.get("optional"))
                )
            elif vf.get("secretKeyRef"):
                r = vf["secretKeyRef"]
                value = _lookup(secrets, "secret", r["name"], r["key"], bool(r.get("optional")))
            else:
                raise EnvError(f"env {name}: unsupported valueFrom {sorted(vf)}")
            if value is None:
                continue
            env[name] = value
        else:
            env[name] = expand(str(var.get("value") or ""), env)
    return env


def expand_command(container: Obj, env: Mapping[str, str], image: Image | None = None) -> list[str]:
    """What the container runs, as on a node: command + args, or without a command the
    image's ENTRYPOINT + args (or, with no args either, + its CMD). $(VAR) is expanded in
    the container's own command and args only. No command and no image: an error."""
    command = [expand(str(a), env) for a in (container.get("command") or [])]
    args = [expand(str(a), env) for a in (container.get("args") or [])]
    if command:
        return command + args
    if image is None:
        raise EnvError(f"container {container.get('name')!r} has no command and no image to run")
    return [*image.entrypoint, *(args or image.cmd)]


def _volume_sources(pod: Obj) -> Iterator[Obj]:
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        yield vol
        yield from (vol.get("projected") or {}).get("sources") or []


def referenced_objects(pod: Obj) -> tuple[set[str], set[str]]:
    """Names of the ConfigMaps and Secrets the pod's env and volumes refer to."""
    cms: set[str] = set()
    secrets: set[str] = set()
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for source in c.get("envFrom") or []:
            if source.get("configMapRef"):
                cms.add(source["configMapRef"]["name"])
            if source.get("secretRef"):
                secrets.add(source["secretRef"]["name"])
        for var in c.get("env") or []:
            vf = var.get("valueFrom") or {}
            if vf.get("configMapKeyRef"):
                cms.add(vf["configMapKeyRef"]["name"])
            if vf.get("secretKeyRef"):
                secrets.add(vf["secretKeyRef"]["name"])
    for src in _volume_sources(pod):
        if src.get("configMap"):
            cms.add(src["configMap"]["name"])
        if src.get("secret"):
            secrets.add(src["secret"].get("secretName") or src["secret"].get("name"))
    return cms, secrets
