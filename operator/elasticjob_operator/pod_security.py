"""The "restricted" Pod Security Standard for the pods the operator builds, pure.

The etcd's pod is ours: it gets the whole restricted profile plus a read-only root
filesystem (etcd writes only its data dir, an emptyDir) and a fixed non-root user (the
etcd image does not declare one).

Worker pods are the user's template: :func:`restrict` fills in only what the template
leaves unset, so a restricted namespace admits them as they are, and a user who needs
something else says so (``runAsNonRoot: false``, ``runAsUser: 0``, ``privileged: true``,
their own capabilities) and gets exactly that, in a namespace that allows it. The root
filesystem stays writable: training code writes /tmp, ~/.cache (torch hub, triton, HF)
and wherever its libraries please, and the restricted profile does not ask for it.
"""

from __future__ import annotations

from typing import Any, Final

Obj = dict[str, Any]

# The runtime image's user (Dockerfile: USER 65532:65532), also the etcd's.
NON_ROOT_UID: Final = 65532
RUNTIME_DEFAULT: Final = {"type": "RuntimeDefault"}
# Capabilities that need privilege escalation allowed (the API server refuses the pair).
_NEEDS_ESCALATION: Final = frozenset({"SYS_ADMIN", "CAP_SYS_ADMIN"})

ETCD_POD_SECURITY: Final = {
    "runAsNonRoot": True,
    "runAsUser": NON_ROOT_UID,
    "runAsGroup": NON_ROOT_UID,
    "fsGroup": NON_ROOT_UID,
    "seccompProfile": RUNTIME_DEFAULT,
}
ETCD_CONTAINER_SECURITY: Final = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _runs_as_root(container: Obj, pod: Obj) -> bool:
    user = container.get("runAsUser", pod.get("runAsUser"))
    return user == 0


def restrict_container(container_security: Obj, pod_security: Obj) -> Obj:
    """A container's securityContext with the restricted defaults under what it says."""
    out = dict(container_security)
    privileged = bool(out.get("privileged"))
    capabilities = dict(out.get("capabilities") or {})
    added = {str(c).upper() for c in capabilities.get("add") or []}
    if "allowPrivilegeEscalation" not in out and not privileged and not added & _NEEDS_ESCALATION:
        out["allowPrivilegeEscalation"] = False
    if "drop" not in capabilities and not privileged:
        out["capabilities"] = {**capabilities, "drop": ["ALL"]}
    if (
        "runAsNonRoot" not in out
        and "runAsNonRoot" not in pod_security
        and not _runs_as_root(out, pod_security)
    ):
        out["runAsNonRoot"] = True
    return out


def restrict(pod_spec: Obj) -> None:
    """Fill in the restricted profile where the worker template is silent, in place:
    seccomp RuntimeDefault for the pod; for every container and init container, no
    privilege escalation, every capability dropped, and a non-root user."""
    pod_security = dict(pod_spec.get("securityContext") or {})
    if "seccompProfile" not in pod_security:
        pod_security["seccompProfile"] = dict(RUNTIME_DEFAULT)
    pod_spec["securityContext"] = pod_security
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            container["securityContext"] = restrict_container(
                dict(container.get("securityContext") or {}), pod_security
            )
