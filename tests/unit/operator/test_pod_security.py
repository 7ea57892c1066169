"""Restricted Pod Security for the pods the operator builds: the etcd's in full, the
workers' filled in only where the user's template is silent."""

from __future__ import annotations

from typing import Any

from elasticjob_operator import builders, models, pod_security
from elasticjob_operator.builders import JobRef

REF = JobRef(name="train", namespace="ml", uid="uid-1")
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
}


def worker(template_spec: dict[str, Any]) -> dict[str, Any]:
    spec = models.ElasticJobSpec.model_validate(
        {
            "minReplicas": 1,
            "replicaSpecs": {"Worker": {"template": {"spec": template_spec}}},
        }
    )
    pod: dict[str, Any] = builders.worker_pod(REF, spec, 0, 0)["spec"]
    return pod


def test_a_silent_template_gets_the_whole_restricted_profile() -> None:
    pod = worker(
        {
            "initContainers": [{"name": "fetch", "image": "i"}],
            "containers": [{"name": "t", "image": "i"}, {"name": "side", "image": "s"}],
        }
    )
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    for container in pod["initContainers"] + pod["containers"]:
        assert container["securityContext"] == RESTRICTED_CONTAINER
        assert "readOnlyRootFilesystem" not in container["securityContext"]  # /tmp, caches


def test_what_the_template_says_is_kept() -> None:
    pod = worker(
        {
            "securityContext": {"runAsUser": 1000, "seccompProfile": {"type": "Localhost"}},
            "containers": [
                {
                    "name": "t",
                    "image": "i",
                    "securityContext": {
                        "allowPrivilegeEscalation": True,
                        "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW"]},
                        "readOnlyRootFilesystem": True,
                    },
                }
            ],
        }
    )
    assert pod["securityContext"] == {"runAsUser": 1000, "seccompProfile": {"type": "Localhost"}}
    assert pod["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": True,
        "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }


def test_added_capabilities_keep_everything_else_dropped() -> None:
    got = pod_security.restrict_container({"capabilities": {"add": ["SYS_PTRACE"]}}, {})
    assert got["capabilities"] == {"add": ["SYS_PTRACE"], "drop": ["ALL"]}
    assert got["allowPrivilegeEscalation"] is False


def test_a_user_who_asks_for_root_or_privilege_gets_no_contradicting_default() -> None:
    # each of these would make the API server or the kubelet refuse the pod if the
    # restricted default were added beside it
    assert pod_security.restrict_container({"runAsUser": 0}, {}) == {
        "runAsUser": 0,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert "runAsNonRoot" not in pod_security.restrict_container({}, {"runAsUser": 0})
    assert "runAsNonRoot" not in pod_security.restrict_container({}, {"runAsNonRoot": False})
    assert pod_security.restrict_container({"runAsNonRoot": False}, {})["runAsNonRoot"] is False
    assert pod_security.restrict_container({"privileged": True}, {}) == {
        "privileged": True,
        "runAsNonRoot": True,
    }
    sys_admin = pod_security.restrict_container({"capabilities": {"add": ["SYS_ADMIN"]}}, {})
    assert "allowPrivilegeEscalation" not in sys_admin


def test_the_etcd_runs_restricted_non_root_on_a_read_only_root() -> None:
    spec = models.ElasticJobSpec.model_validate(
        {
            "minReplicas": 1,
            "replicaSpecs": {
                "Worker": {"template": {"spec": {"containers": [{"name": "t", "image": "i"}]}}}
            },
        }
    )
    pod = builders.etcd_deployment(REF, spec)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    [container] = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # the one place etcd writes is a volume, not the root filesystem; the rest are read-only
    [data] = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    assert data["mountPath"] == builders.ETCD_DATA_DIR
    assert {"name": data["name"], "emptyDir": {}} in pod["volumes"]
