"""Worker pods, Services and the etcd as the operator builds them: names, labels, owner
references, and the environment contract shared with the runtime."""

from __future__ import annotations

from typing import Any

import pytest

from elasticjob_operator import builders, models
from elasticjob_operator.builders import JobRef
from elasticjob_runtime import contract

REF = JobRef(name="train", namespace="ml", uid="uid-1")


def make_spec(**over: Any) -> models.ElasticJobSpec:
    container = over.pop(
        "container",
        {"name": "trainer", "image": "img", "command": ["elasticjob-run", "train.py"]},
    )
    raw: dict[str, Any] = {
        "minReplicas": 2,
        "maxReplicas": 4,
        "replicaSpecs": {
            "Worker": {
                "replicas": 3,
                "template": {
                    "metadata": {"labels": {"team": "ml"}, "annotations": {"a": "b"}},
                    "spec": {
                        "containers": [container, {"name": "side", "image": "s"}],
                        "restartPolicy": "Always",
                        "nodeSelector": {"gpu": "yes"},
                    },
                },
            }
        },
    }
    raw.update(over)
    return models.ElasticJobSpec.model_validate(raw)


def env_of(pod: dict[str, Any], container: int = 0) -> dict[str, Any]:
    return {e["name"]: e for e in pod["spec"]["containers"][container]["env"]}


def test_worker_pod_has_stable_name_identity_and_owner() -> None:
    pod = builders.worker_pod(REF, make_spec(), 2, 0)
    meta = pod["metadata"]
    assert meta["name"] == "train-worker-2"
    assert meta["namespace"] == "ml"
    assert meta["labels"] == {
        "team": "ml",
        "elastic.pytorch.org/job-name": "train",
        "elastic.pytorch.org/replica-type": "worker",
        "elastic.pytorch.org/replica-index": "2",
        "elastic.pytorch.org/incarnation": "0",
        "app.kubernetes.io/managed-by": "elasticjob-operator",
        "elastic.pytorch.org/job-uid": "uid-1",
    }
    assert meta["annotations"] == {"a": "b"}
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "elastic.pytorch.org/v1alpha1",
            "kind": "ElasticJob",
            "name": "train",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    spec = pod["spec"]
    assert spec["hostname"] == "train-worker-2"
    assert spec["subdomain"] == "train-worker"
    assert spec["restartPolicy"] == "Never"  # the operator replaces, so it can count
    assert spec["nodeSelector"] == {"gpu": "yes"}  # template fields pass through
    assert spec["containers"][0]["command"] == ["elasticjob-run", "train.py"]


def test_worker_env_is_the_contract() -> None:
    spec = make_spec(rdzvConf={"join_timeout": "900", "close_timeout": "5"}, nprocPerNode="auto")
    env = env_of(builders.worker_pod(REF, spec, 0, 0))
    assert env[contract.RDZV_ID]["value"] == "uid-1"
    assert env[contract.RDZV_BACKEND]["value"] == "etcd-v3"
    assert env[contract.RDZV_ENDPOINT]["value"] == "https://train-etcd.ml.svc:2379"
    assert env[contract.NNODES]["value"] == "2:4"
    assert env[contract.DESIRED_NODES]["value"] == "3"  # the first round waits for them
    assert env[contract.NPROC_PER_NODE]["value"] == "auto"
    assert env[contract.MAX_RESTARTS]["value"] == str(models.DEFAULT_MAX_RESTARTS)
    assert env[contract.RDZV_CONF]["value"] == "close_timeout=5,join_timeout=900"
    assert env[contract.JOB_NAME]["value"] == "train"
    assert env[contract.JOB_NAMESPACE]["value"] == "ml"
    assert env[contract.JOB_UID]["value"] == "uid-1"  # the job identity of its checkpoints
    assert env[contract.POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[contract.POD_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[contract.NODE_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # every container gets it, sidecars too
    assert env_of(builders.worker_pod(REF, spec, 0, 0), 1)[contract.RDZV_ID]["value"] == "uid-1"


def test_the_desired_node_count_is_what_a_queue_admitted() -> None:
    capped = make_spec().capped(2)  # Kueue admitted 2 of the 3
    env = env_of(builders.worker_pod(REF, capped, 0, 0))
    assert env[contract.DESIRED_NODES]["value"] == "2"
    assert env[contract.NNODES]["value"] == "2:4"


def test_the_hang_timeout_reaches_the_workers_only_when_set() -> None:
    assert contract.HANG_TIMEOUT not in env_of(builders.worker_pod(REF, make_spec(), 0, 0))
    env = env_of(builders.worker_pod(REF, make_spec(hangTimeoutSeconds=45), 0, 0))
    assert env[contract.HANG_TIMEOUT]["value"] == "45"


def test_a_variable_the_template_sets_is_kept() -> None:
    container = {
        "name": "trainer",
        "image": "img",
        "env": [{"name": contract.NPROC_PER_NODE, "value": "7"}, {"name": "X", "value": "1"}],
    }
    env = builders.worker_pod(REF, make_spec(container=container), 0, 0)["spec"]["containers"][0][
        "env"
    ]
    names = [e["name"] for e in env]
    assert names.count(contract.NPROC_PER_NODE) == 1
    assert env[0] == {"name": contract.NPROC_PER_NODE, "value": "7"}
    assert "X" in names and contract.RDZV_ID in names


def test_incarnation_changes_the_rendezvous_id() -> None:
    env = env_of(builders.worker_pod(REF, make_spec(), 0, 3))
    assert env[contract.RDZV_ID]["value"] == "uid-1-3"


def test_endpoint_is_the_users_when_given() -> None:
    spec = make_spec(rdzvEndpoint="etcd-service:2379")
    assert env_of(builders.worker_pod(REF, spec, 0, 0))[contract.RDZV_ENDPOINT]["value"] == (
        "etcd-service:2379"
    )


def test_building_a_pod_does_not_mutate_the_spec() -> None:
    spec = make_spec()
    before = spec.model_dump()
    builders.worker_pod(REF, spec, 0, 0)
    builders.worker_pod(REF, spec, 1, 0)
    assert spec.model_dump() == before


def shm_mounts(pod: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per container (init containers first), its volumeMounts at /dev/shm."""
    spec = pod["spec"]
    return [
        [m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/dev/shm"]
        for c in (spec.get("initContainers") or []) + spec["containers"]
    ]


def spec_with_pod(
    container: dict[str, Any], *, shm_size: str = "2Gi", **pod: Any
) -> models.ElasticJobSpec:
    """make_spec's job with more PodSpec fields in the template (volumes, hostIPC...)."""
    raw = make_spec(container=container, shmSize=shm_size).model_dump(mode="json", by_alias=True)
    raw["replicaSpecs"]["Worker"]["template"]["spec"].update(pod)
    return models.ElasticJobSpec.model_validate(raw)


TRAINER = {"name": "trainer", "image": "img"}
# the provisioned etcd's client certificate, in every worker pod (see the TLS tests below)
TLS_VOLUME = {"name": "elasticjob-etcd-tls", "secret": {"secretName": "train-etcd-client-tls"}}


def test_every_worker_container_gets_a_memory_backed_dev_shm_of_the_default_size() -> None:
    pod = builders.worker_pod(REF, make_spec(), 0, 0)
    assert pod["spec"]["volumes"] == [
        {"name": "elasticjob-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        TLS_VOLUME,
    ]
    assert shm_mounts(pod) == [[{"name": "elasticjob-shm", "mountPath": "/dev/shm"}]] * 2


def test_shm_size_sets_the_limit_and_keeps_the_templates_volumes_and_mounts() -> None:
    volumes = [
        {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}},
        {"name": "elasticjob-shm", "emptyDir": {}},  # the name is taken: ours moves aside
    ]
    container = {**TRAINER, "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]}
    spec = spec_with_pod(container, shm_size="16Gi", volumes=volumes, initContainers=[TRAINER])
    pod = builders.worker_pod(REF, spec, 0, 0)
    assert pod["spec"]["volumes"] == [
        *volumes,
        {"name": "elasticjob-shm-2", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        TLS_VOLUME,
    ]
    assert pod["spec"]["containers"][0]["volumeMounts"][0] == {"name": "ckpt", "mountPath": "/ckpt"}
    assert shm_mounts(pod) == [[{"name": "elasticjob-shm-2", "mountPath": "/dev/shm"}]] * 3


def test_a_template_that_mounts_its_own_dev_shm_is_left_alone() -> None:
    mine = {"name": "mine", "emptyDir": {"medium": "Memory", "sizeLimit": "40Gi"}}
    container = {**TRAINER, "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm/"}]}
    pod = builders.worker_pod(REF, spec_with_pod(container, volumes=[mine]), 0, 0)
    assert pod["spec"]["volumes"] == [mine, TLS_VOLUME]
    assert shm_mounts(pod) == [[], []]  # the sidecar is not touched


def test_a_host_ipc_pod_keeps_the_hosts_dev_shm() -> None:
    pod = builders.worker_pod(REF, spec_with_pod(TRAINER, hostIPC=True), 0, 0)
    assert pod["spec"]["volumes"] == [TLS_VOLUME]
    assert shm_mounts(pod) == [[], []]


@pytest.mark.parametrize("size", ["0", "0Gi"])
def test_shm_size_zero_adds_no_volume(size: str) -> None:
    pod = builders.worker_pod(REF, make_spec(shmSize=size), 0, 0)
    assert pod["spec"]["volumes"] == [TLS_VOLUME]
    assert shm_mounts(pod) == [[], []]


def test_workers_tolerate_a_lost_node_briefly_unless_the_template_says_otherwise() -> None:
    pod = builders.worker_pod(REF, make_spec(), 0, 0)
    assert pod["spec"]["tolerations"] == [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 10}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    raw = make_spec().model_dump(by_alias=True, exclude_none=True)
    raw["replicaSpecs"]["Worker"]["template"]["spec"]["tolerations"] = [own]
    pod = builders.worker_pod(REF, models.ElasticJobSpec.model_validate(raw), 0, 0)
    assert pod["spec"]["tolerations"][0] == own  # kept as the template says: no expiry
    assert [t["key"] for t in pod["spec"]["tolerations"]] == [
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/not-ready",
    ]


def test_headless_service_selects_the_workers() -> None:
    svc = builders.worker_service(REF)
    assert svc["metadata"]["name"] == "train-worker"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == builders.worker_selector("train")
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


@pytest.mark.parametrize(
    ("resources", "want"),
    [
        (None, {"requests": {"cpu": "100m", "memory": "128Mi"}}),  # Burstable: never starved
        ({}, None),  # asked for BestEffort
    ],
)
def test_the_etcd_requests_cpu_unless_told_otherwise(
    resources: dict[str, Any] | None, want: dict[str, Any] | None
) -> None:
    etcd = {"resources": resources} if resources is not None else {}
    dep = builders.etcd_deployment(REF, make_spec(etcd=etcd))
    assert dep["spec"]["template"]["spec"]["containers"][0].get("resources") == want


def test_etcd_deployment_and_service() -> None:
    spec = make_spec(etcd={"image": "etcd:test", "resources": {"limits": {"cpu": "1"}}})
    dep = builders.etcd_deployment(REF, spec)
    assert dep["metadata"]["name"] == "train-etcd"
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"][builders.LABEL_ROLE] == "etcd"
    # its ReplicaSet and pod carry the job's uid: deleted by it with the job
    assert pod["metadata"]["labels"][builders.LABEL_JOB_UID] == "uid-1"
    assert set(dep["spec"]["selector"]["matchLabels"].items()) <= set(
        pod["metadata"]["labels"].items()
    )
    container = pod["spec"]["containers"][0]
    assert container["image"] == "etcd:test"
    assert container["resources"] == {"limits": {"cpu": "1"}}
    assert "--advertise-client-urls=https://train-etcd.ml.svc:2379" in container["args"]
    assert (
        "--listen-client-urls=https://$(ELASTICJOB_POD_IP):2379,https://127.0.0.1:2379"
        in container["args"]
    )
    assert container["env"] == [
        {"name": "ELASTICJOB_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ]
    # probed where no client certificate is asked for: /health on the metrics port
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 2381}
    svc = builders.etcd_service(REF)
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    port = svc["spec"]["ports"][0]
    assert port["port"] == port["targetPort"] == 2379  # no kube-proxy needed to reach it
    default = builders.etcd_deployment(REF, make_spec())
    assert default["spec"]["template"]["spec"]["containers"][0]["image"] == (
        models.DEFAULT_ETCD_IMAGE
    )


def test_the_jobs_etcd_grants_the_runtimes_one_second_leases() -> None:
    # etcd's minimum lease TTL is ceil((3 * election ticks // 2) * heartbeat) seconds,
    # election ticks = election timeout // heartbeat (server/etcdserver/server.go); with
    # its defaults (100 ms, 1000 ms) 2 s. tests/integration proves it on a real etcd.
    pod = builders.etcd_deployment(REF, make_spec())["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in args if "=" in a)
    heartbeat, election = int(flags["heartbeat-interval"]), int(flags["election-timeout"])
    assert election >= 5 * heartbeat  # etcd refuses to start otherwise
    min_ttl_ms = (3 * (election // heartbeat) // 2) * heartbeat
    assert -(-min_ttl_ms // 1000) == 1


def test_the_jobs_etcd_leaves_a_lost_node_as_soon_as_the_workers_do() -> None:
    """Kubernetes' default 300 s would leave the job without its rendezvous that long."""
    pod = builders.etcd_deployment(REF, make_spec())["spec"]["template"]
    assert pod["spec"]["tolerations"] == [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": builders.NODE_LOST_TOLERATION_SECONDS,
        }
        for key in builders.NODE_LOST_TAINTS
    ]


# -- probes on the runtime's health server ----------------------------------------------


def trainer(pod: dict[str, Any], index: int = 0) -> dict[str, Any]:
    container: dict[str, Any] = pod["spec"]["containers"][index]
    return container


def test_the_container_running_elasticjob_run_is_probed_on_its_health_server() -> None:
    c = trainer(builders.worker_pod(REF, make_spec(), 0, 0))
    assert c["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": contract.DEFAULT_HEALTH_PORT},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }
    # the imports before the health server listens: three minutes, liveness held back
    assert c["startupProbe"] == {
        "httpGet": {"path": "/healthz", "port": contract.DEFAULT_HEALTH_PORT},
        "periodSeconds": 2,
        "timeoutSeconds": 5,
        "failureThreshold": 90,
    }
    assert c["readinessProbe"] == {
        "httpGet": {"path": "/readyz", "port": contract.DEFAULT_HEALTH_PORT},
        "periodSeconds": 5,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }
    assert c["ports"] == [{"name": "health", "containerPort": 8090, "protocol": "TCP"}]


def test_the_agents_liveness_period_is_the_operators_and_no_probe_outlasts_it() -> None:
    c = trainer(builders.worker_pod(REF, make_spec(), 0, 0, liveness_period_seconds=3))
    assert c["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": contract.DEFAULT_HEALTH_PORT},
        "periodSeconds": 3,
        "timeoutSeconds": 3,
        "failureThreshold": 3,
    }
    assert c["startupProbe"]["periodSeconds"] == 2  # the imports still get three minutes


@pytest.mark.parametrize(
    "container",
    [
        {"name": "t", "image": "i", "command": ["torchrun", "train.py"]},
        {
            "name": "t",
            "image": "i",
            "command": ["python", "-m", "elasticjob_runtime.launch.launcher"],
        },
        {"name": "t", "image": "i", "args": ["train.py"]},  # the image's ENTRYPOINT: unknown
        {"name": "t", "image": "i", "command": ["sh", "-c", "elasticjob-run train.py"]},
    ],
)
def test_a_container_without_elasticjob_run_gets_no_probe(container: dict[str, Any]) -> None:
    pod = builders.worker_pod(REF, make_spec(container=container), 0, 0)
    for c in pod["spec"]["containers"]:
        assert not {"livenessProbe", "readinessProbe", "startupProbe", "ports"} & set(c)


def test_only_the_first_container_running_elasticjob_run_is_probed() -> None:
    raw = make_spec().model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["replicaSpecs"]["Worker"]["template"]["spec"]["containers"] = [
        {"name": "log", "image": "i", "command": ["tail", "-f"]},
        {"name": "a", "image": "i", "command": ["/opt/venv/bin/elasticjob-run", "a.py"]},
        {"name": "b", "image": "i", "command": ["elasticjob-run", "b.py"]},
    ]
    pod = builders.worker_pod(REF, models.ElasticJobSpec.model_validate(raw), 0, 0)
    probed = [c["name"] for c in pod["spec"]["containers"] if "livenessProbe" in c]
    assert probed == ["a"]


def test_a_probe_the_template_sets_is_kept() -> None:
    mine = {"exec": {"command": ["true"]}, "periodSeconds": 30}
    container = {
        "name": "t",
        "image": "i",
        "command": ["elasticjob-run", "train.py"],
        "livenessProbe": mine,
        "ports": [{"name": "metrics", "containerPort": 9000}],
    }
    c = trainer(builders.worker_pod(REF, make_spec(container=container), 0, 0))
    assert c["livenessProbe"] == mine
    assert "startupProbe" not in c  # nothing in front of the template's own liveness probe
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8090}
    assert c["ports"] == [
        {"name": "metrics", "containerPort": 9000},
        {"name": "health", "containerPort": 8090, "protocol": "TCP"},
    ]


def test_the_containers_own_health_port_is_probed() -> None:
    container = {
        "name": "t",
        "image": "i",
        "command": ["elasticjob-run", "train.py"],
        "env": [{"name": contract.HEALTH_PORT, "value": "9100"}],
        "ports": [{"name": "health", "containerPort": 9100}],  # declared already: kept
    }
    c = trainer(builders.worker_pod(REF, make_spec(container=container), 0, 0))
    assert c["livenessProbe"]["httpGet"]["port"] == 9100
    assert c["readinessProbe"]["httpGet"]["port"] == 9100
    assert c["ports"] == [{"name": "health", "containerPort": 9100}]


@pytest.mark.parametrize(
    "var",
    [
        {"name": contract.HEALTH_PORT, "value": "0"},  # a free port: unknown here
        {"name": contract.HEALTH_PORT, "value": "$(PORT)"},
        {"name": contract.HEALTH_PORT, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
    ],
)
def test_a_health_port_unknown_to_the_operator_means_no_probe(var: dict[str, Any]) -> None:
    container = {"name": "t", "image": "i", "command": ["elasticjob-run", "x.py"], "env": [var]}
    c = trainer(builders.worker_pod(REF, make_spec(container=container), 0, 0))
    assert "livenessProbe" not in c and "readinessProbe" not in c


def test_a_port_name_taken_elsewhere_in_the_pod_is_not_reused() -> None:
    raw = make_spec().model_dump(mode="json", by_alias=True, exclude_none=True)
    template = raw["replicaSpecs"]["Worker"]["template"]["spec"]
    template["containers"][1]["ports"] = [{"name": "health", "containerPort": 80}]
    pod = builders.worker_pod(REF, models.ElasticJobSpec.model_validate(raw), 0, 0)
    assert trainer(pod)["ports"] == [{"containerPort": 8090, "protocol": "TCP"}]
    assert trainer(pod)["livenessProbe"]["httpGet"]["port"] == 8090


def test_health_probes_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builders, "HEALTH_PROBES", False)
    c = trainer(builders.worker_pod(REF, make_spec(), 0, 0))
    assert "livenessProbe" not in c and "readinessProbe" not in c and "ports" not in c


# -- mutual TLS to the rendezvous etcd ---------------------------------------------------


def test_the_provisioned_etcd_serves_mutual_tls_from_its_server_secret_only() -> None:
    pod = builders.etcd_deployment(REF, make_spec())["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert "--client-cert-auth" in args  # a client without the job's certificate is refused
    assert "--trusted-ca-file=/etc/etcd/tls/ca.crt" in args
    assert "--cert-file=/etc/etcd/tls/tls.crt" in args
    assert "--key-file=/etc/etcd/tls/tls.key" in args
    assert not [a for a in args if "client-urls=http://" in a]  # no plain-text client port
    # the three files etcd reads; the Secret's CA key is not mounted
    assert pod["volumes"][1] == {
        "name": "tls",
        "secret": {
            "secretName": "train-etcd-server-tls",
            "items": [{"key": k, "path": k} for k in ("ca.crt", "tls.crt", "tls.key")],
        },
    }
    assert {"name": "tls", "mountPath": "/etc/etcd/tls", "readOnly": True} in container[
        "volumeMounts"
    ]
    # workers never see the server's key; the etcd never sees the clients'
    worker = builders.worker_pod(REF, make_spec(), 0, 0)["spec"]
    assert "train-etcd-server-tls" not in str(worker)
    assert "train-etcd-client-tls" not in str(pod)


def test_workers_get_the_client_secret_the_https_endpoint_and_the_tls_variables() -> None:
    pod = builders.worker_pod(REF, make_spec(), 1, 0)
    assert TLS_VOLUME in pod["spec"]["volumes"]
    for index in (0, 1):  # every container, sidecars too
        container = pod["spec"]["containers"][index]
        assert {
            "name": "elasticjob-etcd-tls",
            "mountPath": "/etc/elasticjob/etcd-tls",
            "readOnly": True,
        } in container["volumeMounts"]
        env = env_of(pod, index)
        assert env[contract.RDZV_ENDPOINT]["value"] == "https://train-etcd.ml.svc:2379"
        assert env[contract.ETCD_CACERT]["value"] == "/etc/elasticjob/etcd-tls/ca.crt"
        assert env[contract.ETCD_CERT]["value"] == "/etc/elasticjob/etcd-tls/tls.crt"
        assert env[contract.ETCD_KEY]["value"] == "/etc/elasticjob/etcd-tls/tls.key"


def test_a_users_etcd_with_rdzv_tls_gets_its_secret_mounted() -> None:
    spec = make_spec(rdzvEndpoint="https://etcd.infra:2379", rdzvTLS={"secretName": "etcd-client"})
    pod = builders.worker_pod(REF, spec, 0, 0)
    assert {"name": "elasticjob-etcd-tls", "secret": {"secretName": "etcd-client"}} in pod["spec"][
        "volumes"
    ]
    env = env_of(pod)
    assert env[contract.RDZV_ENDPOINT]["value"] == "https://etcd.infra:2379"
    assert env[contract.ETCD_CERT]["value"] == "/etc/elasticjob/etcd-tls/tls.crt"
    assert contract.RDZV_CONF not in env


def test_torchs_own_etcd_backend_gets_the_files_as_its_rdzv_conf_keys() -> None:
    spec = make_spec(
        rdzvBackend="etcd",
        rdzvEndpoint="etcd.infra:2379",
        rdzvTLS={"secretName": "etcd-client"},
        rdzvConf={"cert": "/mine.crt"},
    )
    conf = env_of(builders.worker_pod(REF, spec, 0, 0))[contract.RDZV_CONF]["value"]
    assert conf == (
        "cacert=/etc/elasticjob/etcd-tls/ca.crt,cert=/mine.crt,"
        "key=/etc/elasticjob/etcd-tls/tls.key,protocol=https"
    )  # the spec's own keys win


def test_a_users_etcd_without_rdzv_tls_and_c10d_get_no_certificates() -> None:
    for spec in (make_spec(rdzvEndpoint="etcd:2379"), make_spec(rdzvBackend="c10d")):
        pod = builders.worker_pod(REF, spec, 0, 0)
        assert "elasticjob-etcd-tls" not in str(pod["spec"]["volumes"])
        assert contract.ETCD_CACERT not in env_of(pod)
        assert "https://" not in env_of(pod)[contract.RDZV_ENDPOINT]["value"]


def test_the_longest_name_and_highest_index_still_make_a_valid_hostname() -> None:
    longest = builders.worker_pod_name("a" * models.MAX_NAME_LENGTH, models.MAX_REPLICAS - 1)
    assert len(longest) == 63
