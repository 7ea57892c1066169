"""Pure builders of a job's children: worker pods, the headless Service, the etcd.

Plain functions from the parsed job to Kubernetes manifests (dicts), so every name,
label, owner reference and environment variable is checked by unit tests without a
cluster.
"""

from __future__ import annotations

import copy
import posixpath
from dataclasses import dataclass
from typing import Any, Final

from elasticjob_operator import models, pod_security
from elasticjob_operator.kueue.admission import Placement
from elasticjob_runtime import contract

Obj = dict[str, Any]

LABEL_JOB: Final = f"{models.GROUP}/job-name"
LABEL_ROLE: Final = f"{models.GROUP}/replica-type"
LABEL_INDEX: Final = f"{models.GROUP}/replica-index"
LABEL_INCARNATION: Final = f"{models.GROUP}/incarnation"
LABEL_JOB_UID: Final = f"{models.GROUP}/job-uid"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGER: Final = "elasticjob-operator"
ROLE_WORKER: Final = "worker"
ROLE_ETCD: Final = "etcd"
ETCD_DATA_DIR: Final = "/var/lib/etcd"
# The provisioned etcd speaks mutual TLS (elasticjob_operator.etcd.secrets): its server
# Secret is mounted here in the etcd pod, the client Secret (or spec.rdzvTLS's) in workers.
ETCD_TLS_DIR: Final = "/etc/etcd/tls"
WORKER_ETCD_TLS_DIR: Final = "/etc/elasticjob/etcd-tls"
ETCD_TLS_VOLUME: Final = "elasticjob-etcd-tls"
# the keys of both Secrets (and of spec.rdzvTLS's), as kubernetes.io/tls names them
TLS_CA: Final = "ca.crt"
TLS_CERT: Final = "tls.crt"
TLS_KEY: Final = "tls.key"
# the CA's key, in the server Secret only, and never mounted: the operator issues a new
# client certificate with it (elasticjob_operator.etcd.secrets)
TLS_CA_KEY: Final = "ca.key"
ETCD_MOUNTED_KEYS: Final = (TLS_CA, TLS_CERT, TLS_KEY)
# /health without a client certificate, for the readiness probe (serves no keys)
ETCD_METRICS_PORT: Final = 2381
SHM_VOLUME: Final = "elasticjob-shm"
# The etcd's requests unless spec.etcd.resources says otherwise. Without any it would be
# BestEffort, whose cgroup gets the least CPU share there is: on a node whose workers keep
# every core busy it starved, and the workers lost their leases (kind, 2 cores).
ETCD_RESOURCES: Final = {"requests": {"cpu": "100m", "memory": "128Mi"}}

# Liveness and readiness probes on the health server elasticjob-run starts in every pod
# (elasticjob_runtime.launch.health): False builds worker pods without them.
HEALTH_PROBES = True
LAUNCHER: Final = "elasticjob-run"
HEALTH_PORT_NAME: Final = "health"
# The launcher imports torch before it listens, which took up to a minute on a busy
# 2-core node: a startup probe gives it three minutes, and no other probe runs before it
# answered once. Then liveness is generous (a busy node must never trip it) and still
# kills a frozen agent three periods after it froze (the chart's
# agentLivenessPeriodSeconds; 30 s by default), from its first minute on.
STARTUP: Final = {"periodSeconds": 2, "timeoutSeconds": 5, "failureThreshold": 90}
LIVENESS_PERIOD_SECONDS: Final = 10
LIVENESS_TIMEOUT_SECONDS: Final = 5
LIVENESS_FAILURES: Final = 3
READINESS: Final = {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}
# How long a worker pod stays bound to a node the node controller has tainted unreachable
# or not ready before the taint manager evicts it (Kubernetes' default is 300 s). Its
# peers dropped it within a second (its rendezvous lease); the eviction starts the delete
# that the operator completes (rule "Worker on a lost node") and then replaces the pod.
NODE_LOST_TOLERATION_SECONDS: Final = 10
NODE_LOST_TAINTS: Final = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


@dataclass(frozen=True)
class JobRef:
    """Identity of the job that owns the children."""

    name: str
    namespace: str
    uid: str

    def owner_reference(self) -> Obj:
        return {
            "apiVersion": models.API_VERSION,
            "kind": models.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def worker_pod_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def worker_service_name(job: str) -> str:
    return f"{job}-worker"


def etcd_name(job: str) -> str:
    return f"{job}-etcd"


def etcd_server_secret_name(job: str) -> str:
    return f"{job}-etcd-server-tls"


def etcd_client_secret_name(job: str) -> str:
    return f"{job}-etcd-client-tls"


def etcd_client_tls_secret(job: str, spec: models.ElasticJobSpec) -> str | None:
    """The Secret with the CA and client certificate the workers (and the operator) use
    for the rendezvous etcd: ours for the provisioned etcd, spec.rdzvTLS's, or none."""
    if spec.provisions_etcd:
        return etcd_client_secret_name(job)
    return spec.rdzv_tls.secret_name if spec.rdzv_tls is not None else None


def worker_selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ROLE: ROLE_WORKER}


def selector_string(job: str) -> str:
    """The worker selector as the scale subresource wants it (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in worker_selector(job).items())


def etcd_selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ROLE: ROLE_ETCD}


def rdzv_endpoint(ref: JobRef, spec: models.ElasticJobSpec, shared: str | None = None) -> str:
    """Where the workers rendezvous: the user's endpoint, the ``shared`` etcd's endpoint
    when the job uses it (:func:`elasticjob_operator.etcd.shared.serves`), our etcd of
    the job's own, or worker 0 (c10d)."""
    if spec.rdzv_endpoint is not None:
        return spec.rdzv_endpoint
    if shared is not None:
        return shared
    if spec.rdzv_backend is models.RdzvBackend.C10D:
        host = f"{worker_pod_name(ref.name, 0)}.{worker_service_name(ref.name)}.{ref.namespace}.svc"
        return f"{host}:{models.C10D_PORT}"
    return f"https://{etcd_name(ref.name)}.{ref.namespace}.svc:{contract.DEFAULT_ETCD_PORT}"


def child_meta(ref: JobRef, name: str, labels: dict[str, str]) -> Obj:
    """Every child's metadata: owned by the job (the garbage collector's backstop) and
    labelled with its uid, which selects exactly this job's children when it is deleted
    (a job of the same name created since has another uid)."""
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**labels, LABEL_MANAGED_BY: MANAGER, LABEL_JOB_UID: ref.uid},
        "ownerReferences": [ref.owner_reference()],
    }


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def worker_env(
    ref: JobRef, spec: models.ElasticJobSpec, incarnation: int, shared: str | None = None
) -> list[Obj]:
    """The contract's variables: what torchrun reads (PET_*) plus our pod identity."""
    env: list[Obj] = [
        {"name": contract.RDZV_ID, "value": models.run_id(ref.uid, incarnation)},
        {"name": contract.RDZV_BACKEND, "value": spec.rdzv_backend.value},
        {"name": contract.RDZV_ENDPOINT, "value": rdzv_endpoint(ref, spec, shared)},
        {
            "name": contract.NNODES,
            "value": f"{spec.min_replicas}:{spec.effective_max_replicas}",
        },
        # the workers this round creates (a queue's admission caps it): the rendezvous's
        # first round waits for them, not only for those whose agents are up yet
        {"name": contract.DESIRED_NODES, "value": str(spec.desired_replicas)},
        {"name": contract.NPROC_PER_NODE, "value": str(spec.nproc_per_node)},
        {"name": contract.MAX_RESTARTS, "value": str(spec.max_restarts)},
    ]
    if spec.hang_timeout_seconds is not None:
        env.append({"name": contract.HANG_TIMEOUT, "value": str(spec.hang_timeout_seconds)})
    tls = etcd_client_tls_secret(ref.name, spec) is not None
    files = {
        contract.ETCD_CACERT: posixpath.join(WORKER_ETCD_TLS_DIR, TLS_CA),
        contract.ETCD_CERT: posixpath.join(WORKER_ETCD_TLS_DIR, TLS_CERT),
        contract.ETCD_KEY: posixpath.join(WORKER_ETCD_TLS_DIR, TLS_KEY),
    }
    rdzv_conf = dict(spec.rdzv_conf or {})
    if tls and spec.rdzv_backend is models.RdzvBackend.ETCD:
        # torch's own etcd rendezvous reads its TLS from rdzv_conf only
        torch_keys = ("cacert", "cert", "key")
        torch_tls = dict(zip(torch_keys, files.values(), strict=True))
        rdzv_conf = {"protocol": "https", **torch_tls, **rdzv_conf}
    if rdzv_conf:
        conf = ",".join(f"{k}={v}" for k, v in sorted(rdzv_conf.items()))
        env.append({"name": contract.RDZV_CONF, "value": conf})
    if tls:
        env += [{"name": name, "value": path} for name, path in files.items()]
    env += [
        {"name": contract.JOB_NAME, "value": ref.name},
        {"name": contract.JOB_NAMESPACE, "value": ref.namespace},
        {"name": contract.JOB_UID, "value": ref.uid},
        _field_env(contract.POD_NAME, "metadata.name"),
        _field_env(contract.POD_IP, "status.podIP"),
        _field_env(contract.NODE_NAME, "spec.nodeName"),
    ]
    return env


def worker_pod(
    ref: JobRef,
    spec: models.ElasticJobSpec,
    index: int,
    incarnation: int,
    shared: str | None = None,
    placement: Placement | None = None,
    workload_ref: Obj | None = None,
    liveness_period_seconds: int = LIVENESS_PERIOD_SECONDS,
) -> Obj:
    """Worker pod `index`: the template plus stable identity, env and owner reference;
    ``shared``: the shared etcd's endpoint if the job rendezvouses there; ``placement``:
    the node labels and tolerations of the flavors Kueue admitted it on; ``workload_ref``:
    the gang it is placed with (:mod:`elasticjob_operator.gang`); ``liveness_period_seconds``:
    how far apart the agent's liveness probes are (:func:`liveness_timing`).

    The pod's hostname/subdomain make it resolvable as
    `<job>-worker-<i>.<job>-worker.<ns>.svc` through the headless Service. Its
    restartPolicy is always Never: the operator replaces failed pods itself so that it
    can count them against backoffLimit. The restricted Pod Security fields the template
    leaves unset are filled in (:mod:`elasticjob_operator.pod_security`).
    """
    template = spec.worker.template.model_dump(mode="json", by_alias=True, exclude_none=True)
    tmeta: Obj = copy.deepcopy(template.get("metadata") or {})
    pod_spec: Obj = copy.deepcopy(template["spec"])
    name = worker_pod_name(ref.name, index)
    labels = {
        **(tmeta.get("labels") or {}),
        **worker_selector(ref.name),
        LABEL_INDEX: str(index),
        LABEL_INCARNATION: str(incarnation),
    }
    metadata = child_meta(ref, name, labels)
    if tmeta.get("annotations"):
        metadata["annotations"] = dict(tmeta["annotations"])
    injected = worker_env(ref, spec, incarnation, shared)
    for container in pod_spec["containers"]:
        own = list(container.get("env") or [])
        taken = {e.get("name") for e in own}
        container["env"] = own + [e for e in injected if e["name"] not in taken]
    pod_spec["restartPolicy"] = "Never"
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = worker_service_name(ref.name)
    add_shm_volume(pod_spec, spec.shm_size)
    if (secret := etcd_client_tls_secret(ref.name, spec)) is not None:
        add_secret_volume(pod_spec, secret, WORKER_ETCD_TLS_DIR)
    if placement is not None:
        add_placement(pod_spec, placement)
    if workload_ref is not None:
        pod_spec["workloadRef"] = dict(workload_ref)
    add_node_lost_tolerations(pod_spec)
    pod_security.restrict(pod_spec)
    if HEALTH_PROBES:
        add_health_probes(pod_spec, liveness_period_seconds)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def add_placement(pod_spec: Obj, placement: Placement) -> None:
    """Kueue's admitted flavors: their node labels join the node selector, their
    tolerations the template's."""
    if placement.node_selector:
        pod_spec["nodeSelector"] = {
            **(pod_spec.get("nodeSelector") or {}),
            **placement.node_selector,
        }
    tolerations = list(pod_spec.get("tolerations") or [])
    tolerations += [dict(t) for t in placement.tolerations if t not in tolerations]
    if tolerations:
        pod_spec["tolerations"] = tolerations


def add_node_lost_tolerations(pod_spec: Obj) -> None:
    """Tolerate an unreachable or not-ready node for NODE_LOST_TOLERATION_SECONDS only
    (in place), unless the template already says how long for that taint."""
    tolerations: list[Obj] = pod_spec.setdefault("tolerations", [])
    said = {t.get("key") for t in tolerations}
    for key in NODE_LOST_TAINTS:
        if key not in said:
            tolerations.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": NODE_LOST_TOLERATION_SECONDS,
                }
            )


def launcher_container(pod_spec: Obj) -> Obj | None:
    """The first container whose command runs elasticjob-run; None if none does (a
    template running torchrun or python, or giving only args to the image's ENTRYPOINT)."""
    containers: list[Obj] = pod_spec.get("containers") or []
    for container in containers:
        command = container.get("command") or []
        if command and posixpath.basename(str(command[0])) == LAUNCHER:
            return container
    return None


def health_port(container: Obj) -> int | None:
    """Where its health server listens: the container's ELASTICJOB_HEALTH_PORT, else the
    runtime's default; None when that cannot be known here (set from elsewhere with
    valueFrom, not a port, or 0: a free port of the server's choosing)."""
    for var in container.get("env") or []:
        if var.get("name") == contract.HEALTH_PORT:
            raw = str(var.get("value", "")) if "valueFrom" not in var else ""
            return int(raw) if raw.isdigit() and 0 < int(raw) < 65536 else None
    return contract.DEFAULT_HEALTH_PORT


def liveness_timing(period_seconds: int) -> Obj:
    """The agent's liveness probe: three failures ``period_seconds`` apart kill the pod,
    each probe given up to 5 s but never longer than its period."""
    return {
        "periodSeconds": period_seconds,
        "timeoutSeconds": min(LIVENESS_TIMEOUT_SECONDS, period_seconds),
        "failureThreshold": LIVENESS_FAILURES,
    }


def add_health_probes(
    pod_spec: Obj, liveness_period_seconds: int = LIVENESS_PERIOD_SECONDS
) -> None:
    """Probe the runtime's health server in the container that runs elasticjob-run, in
    place: ``startupProbe`` and ``livenessProbe`` on /healthz (a frozen agent does not
    answer; its pod fails and is replaced; the startup probe covers the imports before
    it listens), ``readinessProbe`` on /readyz (ready once its workers have run in a
    round), and a containerPort named ``health``. A probe the template sets is kept (and
    a template's own liveness probe gets no startup probe in front of it)."""
    container = launcher_container(pod_spec)
    port = health_port(container) if container is not None else None
    if container is None or port is None:
        return
    probes = [("readinessProbe", "/readyz", READINESS)]
    if "livenessProbe" not in container:
        liveness = liveness_timing(liveness_period_seconds)
        probes += [("livenessProbe", "/healthz", liveness), ("startupProbe", "/healthz", STARTUP)]
    for key, path, timing in probes:
        if key not in container:
            container[key] = {"httpGet": {"path": path, "port": port}, **timing}
    ports = list(container.get("ports") or [])
    if any(p.get("containerPort") == port for p in ports):
        return
    named = {p.get("name") for c in pod_spec["containers"] for p in c.get("ports") or []}
    entry: Obj = {"containerPort": port, "protocol": "TCP"}
    if HEALTH_PORT_NAME not in named:
        entry = {"name": HEALTH_PORT_NAME, **entry}
    container["ports"] = [*ports, entry]


def _all_containers(pod_spec: Obj) -> list[Obj]:
    return list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])


def owns_shm(pod_spec: Obj) -> bool:
    """The template takes care of /dev/shm itself: a container mounts something there, or
    the pod shares the host's IPC namespace (and with it the host's /dev/shm)."""
    if pod_spec.get("hostIPC"):
        return True
    return any(
        str(m.get("mountPath", "")).rstrip("/") == models.SHM_PATH
        for c in _all_containers(pod_spec)
        for m in c.get("volumeMounts") or []
    )


def add_shm_volume(pod_spec: Obj, size: str) -> None:
    """Give every container a memory-backed /dev/shm of ``size`` (spec.shmSize), in place.

    A container runtime's /dev/shm is 64 MiB: too small for the node-memory checkpoint
    copy of a real model and for DataLoader workers' shared-memory batches. Nothing is
    added when ``size`` is zero or the template already takes care of /dev/shm.
    """
    if models.quantity_bytes(size) == 0 or owns_shm(pod_spec):
        return
    taken = {v.get("name") for v in pod_spec.get("volumes") or []}
    name, n = SHM_VOLUME, 1
    while name in taken:
        n += 1
        name = f"{SHM_VOLUME}-{n}"
    volume = {"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": size}}
    pod_spec["volumes"] = [*(pod_spec.get("volumes") or []), volume]
    for container in _all_containers(pod_spec):
        mount = {"name": name, "mountPath": models.SHM_PATH}
        container["volumeMounts"] = [*(container.get("volumeMounts") or []), mount]


def add_secret_volume(pod_spec: Obj, secret: str, path: str) -> None:
    """Mount Secret ``secret`` read-only at ``path`` in every container, in place (the
    default file mode: a container that runs as another user than root reads it too)."""
    taken = {v.get("name") for v in pod_spec.get("volumes") or []}
    name, n = ETCD_TLS_VOLUME, 1
    while name in taken:
        n += 1
        name = f"{ETCD_TLS_VOLUME}-{n}"
    volume = {"name": name, "secret": {"secretName": secret}}
    pod_spec["volumes"] = [*(pod_spec.get("volumes") or []), volume]
    for container in pod_spec.get("containers") or []:
        mount = {"name": name, "mountPath": path, "readOnly": True}
        container["volumeMounts"] = [*(container.get("volumeMounts") or []), mount]


def disruption_budget_name(job: str) -> str:
    return f"{job}-workers"


def disruption_budget(ref: JobRef, spec: models.ElasticJobSpec) -> Obj:
    """The workers' PodDisruptionBudget: evictions may not leave fewer than minReplicas."""
    name = disruption_budget_name(ref.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(ref, name, {LABEL_JOB: ref.name}),
        "spec": {
            "minAvailable": spec.min_replicas,
            "selector": {"matchLabels": worker_selector(ref.name)},
        },
    }


def worker_service(ref: JobRef) -> Obj:
    """Headless Service giving every worker pod a stable DNS name (and c10d's port)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(ref, worker_service_name(ref.name), worker_selector(ref.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": worker_selector(ref.name),
            "ports": [
                {
                    "name": "c10d",
                    "port": models.C10D_PORT,
                    "targetPort": models.C10D_PORT,
                    "protocol": "TCP",
                }
            ],
        },
    }


def etcd_service(ref: JobRef) -> Obj:
    port = contract.DEFAULT_ETCD_PORT
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(ref, etcd_name(ref.name), etcd_selector(ref.name)),
        "spec": {
            "selector": etcd_selector(ref.name),
            "ports": [{"name": "client", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def _etcd_args(name: str, namespace: str) -> list[str]:
    """A single member serving mutual TLS on the pod IP and loopback, its /health plain."""
    port = contract.DEFAULT_ETCD_PORT
    metrics = ETCD_METRICS_PORT
    advertise = f"https://{name}.{namespace}.svc:{port}"
    pod_ip = f"$({contract.POD_IP})"
    return [
        f"--name={name}",
        f"--data-dir={ETCD_DATA_DIR}",
        f"--listen-client-urls=https://{pod_ip}:{port},https://127.0.0.1:{port}",
        f"--advertise-client-urls={advertise}",
        "--client-cert-auth",
        f"--trusted-ca-file={ETCD_TLS_DIR}/{TLS_CA}",
        f"--cert-file={ETCD_TLS_DIR}/{TLS_CERT}",
        f"--key-file={ETCD_TLS_DIR}/{TLS_KEY}",
        # plain http, /health and /metrics only: what the kubelet's probe can reach
        f"--listen-metrics-urls=http://{pod_ip}:{metrics},http://127.0.0.1:{metrics}",
        "--listen-peer-urls=http://127.0.0.1:2380",
        "--initial-advertise-peer-urls=http://127.0.0.1:2380",
        f"--initial-cluster={name}=http://127.0.0.1:2380",
        "--auto-compaction-mode=revision",
        "--auto-compaction-retention=1000",
        # grants the runtime's 1 s member leases (etcd's defaults raise them to 2 s)
        *contract.ETCD_FAST_LEASE_FLAGS,
    ]


def _etcd_container(ref: JobRef, settings: models.EtcdSpec) -> Obj:
    metrics = ETCD_METRICS_PORT
    container: Obj = {
        "name": "etcd",
        "image": settings.image,
        "command": ["etcd"],
        # Listen on the pod IP (what the Service targets) and loopback, not 0.0.0.0: a
        # node-local service proxy may hold clusterIP:2379 inside the pod's netns.
        "env": [_field_env(contract.POD_IP, "status.podIP")],
        "args": _etcd_args(etcd_name(ref.name), ref.namespace),
        "ports": [
            {"name": "client", "containerPort": contract.DEFAULT_ETCD_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics, "protocol": "TCP"},
        ],
        # ready once it serves (has a leader): the Service sends workers only then
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": metrics},
            "periodSeconds": 2,
            "failureThreshold": 3,
        },
        "volumeMounts": [
            {"name": "data", "mountPath": ETCD_DATA_DIR},
            {"name": "tls", "mountPath": ETCD_TLS_DIR, "readOnly": True},
        ],
        "securityContext": dict(pod_security.ETCD_CONTAINER_SECURITY),
    }
    resources = settings.resources if settings.resources is not None else ETCD_RESOURCES
    if resources:
        container["resources"] = copy.deepcopy(resources)
    return container


def _etcd_pod_spec(ref: JobRef, settings: models.EtcdSpec) -> Obj:
    pod_spec: Obj = {
        "securityContext": dict(pod_security.ETCD_POD_SECURITY),
        "containers": [_etcd_container(ref, settings)],
        "volumes": [
            {"name": "data", "emptyDir": {}},
            {
                "name": "tls",
                "secret": {
                    "secretName": etcd_server_secret_name(ref.name),
                    # what etcd reads; the Secret's ca.key stays out of the pod
                    "items": [{"key": k, "path": k} for k in ETCD_MOUNTED_KEYS],
                },
            },
        ],
    }
    # as the workers: on a lost node the default 300 s would keep the job without its
    # etcd (no regroup, no join) for five minutes before the ReplicaSet replaced it
    add_node_lost_tolerations(pod_spec)
    return pod_spec


def etcd_deployment(ref: JobRef, spec: models.ElasticJobSpec) -> Obj:
    """A single-member etcd for the job's rendezvous (state lives as long as the job).

    Recreate strategy: two members with one data dir would not be a cluster. Clients
    speak mutual TLS: only a certificate from the job's own CA (the workers' client
    Secret) is accepted; the server Secret is mounted here only, without its CA key.
    """
    name = etcd_name(ref.name)
    pod_spec = _etcd_pod_spec(ref, spec.etcd or models.EtcdSpec())
    metadata = child_meta(ref, name, etcd_selector(ref.name))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": etcd_selector(ref.name)},
            "template": {
                # the uid label too: the ReplicaSet and the pod carry it, so a deleted
                # job's are deleted by it (Kube.delete_children)
                "metadata": {"labels": dict(metadata["labels"])},
                "spec": pod_spec,
            },
        },
    }
