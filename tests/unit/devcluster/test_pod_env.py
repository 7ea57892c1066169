"""A container's environment resolves the way kubelet resolves it."""

from __future__ import annotations

import base64

import pytest

from elasticjob_devcluster.container_images import Image
from elasticjob_devcluster.pod_env import (
    EnvError,
    PodContext,
    expand,
    expand_command,
    pod_hostname,
    referenced_objects,
    resolve_env,
    runtime_env,
)

POD = {
    "metadata": {"name": "w-0", "namespace": "ml", "uid": "u-1", "labels": {"role": "worker"}},
    "spec": {"nodeName": "node-1", "serviceAccountName": "trainer"},
}
CTX = PodContext(pod_ip="10.244.1.5", host_ip="127.0.0.1", node_allocatable={"cpu": "2"})
CMS = {"cfg": {"metadata": {"namespace": "ml"}, "data": {"lr": "0.1", "bad key": "x"}}}
SECRETS = {"sec": {"data": {"pw": base64.b64encode(b"hunter2").decode()}}}


def test_expand_replaces_defined_names_keeps_unknown_and_honours_escape() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("cost $5 $(A", env) == "cost $5 $(A"


def test_field_refs_configmap_secret_and_env_from() -> None:
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {
                "name": "ROLE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}},
            },
            {"name": "LR", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "lr"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "pw"}}},
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "MSG", "value": "$(NAME) on $(NODE)"},
        ],
    }
    env = resolve_env(POD, container, CTX, CMS, SECRETS, {"PATH": "/bin"})
    assert env["NAME"] == "w-0" and env["NS"] == "ml" and env["UID"] == "u-1"
    assert env["IP"] == "10.244.1.5" and env["NODE"] == "node-1" and env["ROLE"] == "worker"
    assert env["LR"] == "0.1" and env["PW"] == "hunter2" and env["CPUS"] == "2"
    assert env["MSG"] == "w-0 on node-1" and env["PATH"] == "/bin"
    assert env["CFG_lr"] == "0.1" and "CFG_bad key" not in env


def test_env_overrides_env_from_and_optional_refs_may_be_missing() -> None:
    container = {
        "name": "c",
        "envFrom": [
            {"configMapRef": {"name": "cfg"}},
            {"secretRef": {"name": "nope", "optional": True}},
        ],
        "env": [
            {"name": "lr", "value": "0.5"},
            {
                "name": "X",
                "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k", "optional": True}},
            },
        ],
    }
    env = resolve_env(POD, container, CTX, CMS, SECRETS)
    assert env["lr"] == "0.5" and "X" not in env


def test_missing_required_ref_is_a_config_error_naming_it() -> None:
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "nope"}}}],
    }
    with pytest.raises(EnvError, match="nope"):
        resolve_env(POD, container, CTX, CMS, SECRETS)
    container = {"name": "c", "envFrom": [{"configMapRef": {"name": "absent"}}]}
    with pytest.raises(EnvError, match="absent"):
        resolve_env(POD, container, CTX, CMS, SECRETS)


def test_command_and_args_expand_and_a_missing_command_is_explained() -> None:
    c = {"name": "c", "command": ["python", "-c"], "args": ["print('$(A)')"]}
    assert expand_command(c, {"A": "hi"}) == ["python", "-c", "print('hi')"]
    with pytest.raises(EnvError, match="no command and no image"):
        expand_command({"name": "c", "args": ["x"]}, {})


def test_without_a_command_the_images_entrypoint_runs_as_on_a_node() -> None:
    image = Image(("kopf", "run"), ("--all-namespaces",))
    env = {"A": "hi"}
    # args only: ENTRYPOINT + args (expanded); the image's own words are not
    assert expand_command({"name": "c", "args": ["$(A)"]}, env, image) == ["kopf", "run", "hi"]
    # neither: ENTRYPOINT + CMD
    assert expand_command({"name": "c"}, env, image) == ["kopf", "run", "--all-namespaces"]
    # a command replaces both, and the image's CMD is not appended to it
    assert expand_command({"name": "c", "command": ["x"]}, env, image) == ["x"]
    assert expand_command({"name": "c", "args": ["$(A)"]}, env, Image(("$(A)",))) == [
        "$(A)",
        "hi",
    ]


def test_referenced_objects_cover_env_and_projected_volumes() -> None:
    pod = {
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "envFrom": [{"secretRef": {"name": "s1"}}],
                    "env": [
                        {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "c1", "key": "k"}}}
                    ],
                }
            ],
            "volumes": [
                {"name": "v", "configMap": {"name": "c2"}},
                {"name": "w", "secret": {"secretName": "s2"}},
                {
                    "name": "p",
                    "projected": {"sources": [{"configMap": {"name": "kube-root-ca.crt"}}]},
                },
            ],
        }
    }
    assert referenced_objects(pod) == ({"c1", "c2", "kube-root-ca.crt"}, {"s1", "s2"})


def test_the_hostname_is_spec_hostname_or_the_pod_name_cut_as_kubelet_cuts_it() -> None:
    assert pod_hostname(POD) == "w-0"
    assert pod_hostname({**POD, "spec": {"hostname": "trainer"}}) == "trainer"
    long = {"metadata": {"name": "x" * 62 + "-yz"}, "spec": {}}
    assert pod_hostname(long) == "x" * 62
    host_net = {**POD, "spec": {"hostNetwork": True, "nodeName": "node-1"}}
    assert pod_hostname(host_net) == "node-1"


def test_kubelets_own_variables_point_at_the_kubernetes_service() -> None:
    env = runtime_env(
        POD, {"WEB_SERVICE_HOST": "10.96.0.7"}, "/bin", "/h", "10.96.0.1", "127.0.0.1", 6443
    )
    assert env["WEB_SERVICE_HOST"] == "10.96.0.7"
    assert (env["PATH"], env["HOME"], env["HOSTNAME"]) == ("/bin", "/h", "w-0")
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "443"
    assert env["KUBERNETES_PORT_443_TCP"] == "tcp://10.96.0.1:443"


def test_service_links_can_be_switched_off_and_host_network_pods_dial_the_api_server() -> None:
    no_links = {**POD, "spec": {"enableServiceLinks": False}}
    env = runtime_env(
        no_links, {"WEB_SERVICE_HOST": "x"}, "/bin", "/h", "10.96.0.1", "127.0.0.1", 6443
    )
    assert "WEB_SERVICE_HOST" not in env
    host_net = {**POD, "spec": {"hostNetwork": True}}
    env = runtime_env(host_net, {}, "/bin", "/h", "10.96.0.1", "127.0.0.1", 6443)
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "6443")
    assert env["KUBERNETES_PORT"] == "tcp://127.0.0.1:6443"
