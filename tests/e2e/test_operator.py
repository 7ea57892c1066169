"""The operator on a real cluster, installed the way users install it.

`helm install` puts the chart (CRD, RBAC, the kopf Deployment) on the cluster; the
operator runs as a pod under its own ServiceAccount, so its RBAC is real. On the
devcluster the image is recorded but not pulled: the pod's `kopf run ...` command runs
from this repo's environment, and worker pods run `python -c ...`. Every user action
goes through kubectl; every wait is bounded generously (to catch hangs, not to time).
"""

from __future__ import annotations

import base64
import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store
from elasticjob_manifests import (
    EXIT_ON_SIGTERM,
    MALFORMED,
    PUBLISH_PROGRESS_AND_SLEEP,
    RUNTIME_IMAGE,
    archived,
    archived_args_only,
    job,
    malformed,
)
from kube_helpers import (
    AWAIT_TARGET,
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    WAIT,
    Cluster,
    Obj,
    Operator,
    installed_operator,
    wait_for,
)

from elasticjob_operator.builders import etcd_selector, worker_selector
from elasticjob_runtime import contract

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Unique names, and the operator restricted to its own job namespace (namespaced Roles),
# so the suite can share a cluster with other users of the CRD.
SUFFIX = uuid.uuid4().hex[:6]
RELEASE = OP_NS = f"ejop-{SUFFIX}"
JOB_NS = f"ejjobs-{SUFFIX}"
FULLNAME = f"{RELEASE}-elasticjob-operator"  # the chart's name for its objects
BELOW_MIN_GRACE = 15  # seconds a job may run below minReplicas (chart value)
RESYNC = 4  # seconds between the operator's full resyncs (chart value; its default is 10)

PRINT_ENV_AND_SLEEP = [
    "python",
    "-c",
    EXIT_ON_SIGTERM + "import os, json, time\n"
    "env = {k: v for k, v in os.environ.items() if k.startswith(('PET_', 'ELASTICJOB_'))}\n"
    "print(json.dumps(env), flush=True)\n"
    "time.sleep(3600)\n",
]


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path) -> Cluster:
    return Cluster(kubeconfig)


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Operator]:
    """The chart installed with helm; uninstalled afterwards (the CRD too if we added it)."""
    with installed_operator(
        cluster,
        "ej",
        "--set",
        "metrics.service.enabled=true",
        "--set",
        f"belowMinGraceSeconds={BELOW_MIN_GRACE}",
        "--set",
        f"resyncSeconds={RESYNC}",
        suffix=SUFFIX,
    ) as op:
        assert (op.release, op.namespace, op.job_namespace) == (RELEASE, OP_NS, JOB_NS)
        yield op


@pytest.fixture(scope="module")
def operator(installed: Operator) -> Cluster:
    return installed.cluster


@pytest.fixture
def ns(installed: Operator) -> Iterator[str]:
    """The watched namespace; the jobs a test started are deleted after it."""
    c, job_ns = installed.cluster, installed.job_namespace
    before = {j["metadata"]["name"] for j in c.list_jobs(job_ns)}
    yield job_ns
    for j in c.list_jobs(job_ns):
        if j["metadata"]["name"] not in before:
            c.kubectl(
                "-n",
                job_ns,
                "delete",
                "elasticjob",
                j["metadata"]["name"],
                "--wait=false",
                check=False,
            )


def operator_pods(c: Cluster, running: bool = False) -> list[Any]:
    return Operator(c, RELEASE, OP_NS, JOB_NS).pods(running)


def operator_log(c: Cluster) -> str:
    """Every operator pod's log with its restart count: what a failed check prints."""
    return "".join(
        f"--- {p.metadata.name} (restarts: "
        f"{sum(s.restart_count for s in p.status.container_statuses or [])})\n"
        + c.kubectl("-n", OP_NS, "logs", p.metadata.name, "--all-containers", check=False).stdout
        for p in operator_pods(c)
    )


def start_job(c: Cluster, ns: str, obj: Obj) -> str:
    c.apply(ns, obj)
    name: str = obj["metadata"]["name"]
    return name


# -- install -----------------------------------------------------------------------------


def test_operator_runs_under_its_own_least_privilege_service_account(operator: Cluster) -> None:
    assert [p.spec.service_account_name for p in operator_pods(operator)] == [FULLNAME]
    sa = f"system:serviceaccount:{OP_NS}:{FULLNAME}"

    def can(*what: str) -> bool:
        out = operator.kubectl("auth", "can-i", *what, f"--as={sa}", check=False)
        return out.stdout.strip() == "yes"

    assert can("create", "pods", "-n", JOB_NS)
    assert can("delete", "services", "-n", JOB_NS)
    assert can("create", "deployments.apps", "-n", JOB_NS)
    assert can("patch", "elasticjobs.elastic.pytorch.org", "--subresource=status", "-n", JOB_NS)
    assert can("create", "events", "-n", JOB_NS)
    assert not can("create", "pods", "-n", "default")  # only the watched namespace
    # the jobs' etcd certificates: created and read back, in the watched namespace only;
    # never changed, listed, watched or deleted
    assert can("create", "secrets", "-n", JOB_NS)
    assert can("get", "secrets", "-n", JOB_NS)
    assert not can("update", "secrets", "-n", JOB_NS)
    assert not can("patch", "secrets", "-n", JOB_NS)
    assert not can("list", "secrets", "-n", JOB_NS)
    assert not can("watch", "secrets", "-n", JOB_NS)
    assert not can("delete", "secrets", "-n", JOB_NS)
    assert not can("get", "secrets", "-n", "default")
    assert not can("list", "secrets", "--all-namespaces")
    assert not can("create", "elasticjobs.elastic.pytorch.org", "-n", JOB_NS)
    assert not can("delete", "nodes")


# -- a job's life --------------------------------------------------------------------------


def test_job_gets_its_workers_services_etcd_and_the_env_contract(
    operator: Cluster, ns: str
) -> None:
    c = operator
    name = start_job(c, ns, job("env", PRINT_ENV_AND_SLEEP, replicas=2))
    uid = c.job(ns, name)["metadata"]["uid"]
    running = wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
    assert running
    assert sorted(c.workers(ns, name)) == ["env-worker-0", "env-worker-1"]

    svc = c.core.read_namespaced_service("env-worker", ns)
    assert svc.spec.cluster_ip == "None"
    etcd = wait_for(
        "the job's etcd to be available",
        lambda: (
            (d := c.apps.read_namespaced_deployment("env-etcd", ns)).status.available_replicas and d
        ),
    )
    assert etcd.metadata.owner_references[0].uid == uid
    assert c.core.read_namespaced_service("env-etcd", ns).spec.ports[0].port == 2379

    pod = c.core.read_namespaced_pod("env-worker-1", ns)
    assert pod.metadata.owner_references[0].uid == uid
    assert pod.metadata.owner_references[0].controller is True
    assert (pod.spec.hostname, pod.spec.subdomain) == ("env-worker-1", "env-worker")
    assert pod.metadata.labels["app"] == "env"  # the template's labels are kept

    def logged_env() -> Obj | None:
        out = c.kubectl("-n", ns, "logs", "env-worker-1", check=False).stdout.strip()
        return json.loads(out.splitlines()[0]) if out else None

    env = wait_for("the worker to print its environment", logged_env)
    assert env[contract.RDZV_ID] == uid
    assert env[contract.RDZV_BACKEND] == "etcd-v3"
    assert env[contract.RDZV_ENDPOINT] == f"https://env-etcd.{ns}.svc:2379"
    assert env[contract.ETCD_CACERT] == "/etc/elasticjob/etcd-tls/ca.crt"
    assert env[contract.ETCD_CERT] == "/etc/elasticjob/etcd-tls/tls.crt"
    assert env[contract.ETCD_KEY] == "/etc/elasticjob/etcd-tls/tls.key"
    # the certificates: two Secrets owned by the job, each mounted where it is needed only
    for secret in ("env-etcd-server-tls", "env-etcd-client-tls"):
        owner = c.core.read_namespaced_secret(secret, ns).metadata.owner_references[0]
        assert (owner.uid, owner.controller) == (uid, True)
    mounted = {v.secret.secret_name for v in pod.spec.volumes if v.secret}
    assert mounted == {"env-etcd-client-tls"}
    etcd_pod = etcd.spec.template.spec
    assert {v.secret.secret_name for v in etcd_pod.volumes if v.secret} == {"env-etcd-server-tls"}
    assert env[contract.NNODES] == "1:4"
    assert env[contract.NPROC_PER_NODE] == "1"
    assert env[contract.POD_NAME] == "env-worker-1"  # downward API, resolved in the pod
    assert env[contract.POD_IP] == pod.status.pod_ip
    assert env[contract.JOB_NAME] == "env" and env[contract.JOB_NAMESPACE] == ns
    assert env[contract.JOB_UID] == uid  # with the namespace and run id, its checkpoints' owner

    wait_for("phase Running", lambda: c.status(ns, name).get("phase") == "Running")
    table = c.kubectl("-n", ns, "get", "elasticjobs", name).stdout.splitlines()
    assert table[0].split() == ["NAME", "MIN", "MAX", "DESIRED", "ACTIVE", "STEP", "PHASE", "AGE"]
    # no progress published: the Step column is blank
    assert table[1].split()[:6] == ["env", "1", "4", "2", "2", "Running"]
    wait_for(
        "kubectl wait on the Running condition",
        lambda: (
            c.kubectl(
                "-n",
                ns,
                "wait",
                f"elasticjob/{name}",
                "--for=condition=Running",
                "--timeout=5s",
                check=False,
            ).returncode
            == 0
        ),
    )
    described = c.kubectl("-n", ns, "describe", "elasticjob", name).stdout
    events = described[described.find("Events:") :]
    assert "CreatedWorkers" in events and "ProvisionedEtcd" in events, (
        events + "\noperator log:\n" + operator_log(c)
    )


# What the runtime's rank 0 does: publish its progress record (elasticjob_runtime.etcd.records)
# under contract.progress_key(PET_RDZV_ID) in the job's etcd.


def test_training_progress_shows_in_kubectl_get(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("progress", PUBLISH_PROGRESS_AND_SLEEP, replicas=2))
    status = wait_for(
        "status.progress from the job's etcd",
        lambda: (s := c.status(ns, name)).get("progress", {}).get("step") == 1234 and s,
    )
    assert status["progress"]["worldSize"] == 2
    assert status["progress"]["samplesPerSecond"] == 99.5
    row = c.kubectl("-n", ns, "get", "elasticjob", name).stdout.splitlines()[1].split()
    assert row[5] == "1234"  # the Step column


# -- the job's etcd speaks mutual TLS ---------------------------------------------------

# A pod that is not one of the job's workers tries the job's etcd three ways (plain text;
# TLS with the job's CA but no client certificate; another job's client certificate,
# mounted from that job's Secret) and prints one JSON line: case -> what happened.
INTRUDE = [
    "python",
    "-c",
    AWAIT_TARGET + "import json, os, pathlib\n"
    "from elasticjob_runtime.etcd.tls import connect\n"
    "pathlib.Path('/tmp/ca.crt').write_text(os.environ['TARGET_CA'])\n"
    "target = os.environ['TARGET']\n"
    "other = {'cert': '/other/tls.crt', 'key': '/other/tls.key'}\n"
    "cases = {'plain': ('http://' + target, {}),\n"
    "         'no-certificate': ('https://' + target, {'cacert': '/tmp/ca.crt'}),\n"
    "         'another-jobs-certificate': ('https://' + target,\n"
    "                                      {'cacert': '/tmp/ca.crt', **other})}\n"
    "seen = {}\n"
    "for case, (endpoint, conf) in cases.items():\n"
    "    try:\n"
    "        e = connect(endpoint, conf, env={}, timeout=5)\n"
    "        e.put('/elasticjob/intruder', b'x')\n"
    "        seen[case] = 'wrote: ' + repr(e.get('/elasticjob/intruder'))\n"
    "    except Exception as exc:\n"
    "        seen[case] = f'{type(exc).__name__}: {exc}'\n"
    "print(json.dumps(seen), flush=True)\n",
]


def test_a_pod_without_the_jobs_client_certificate_cannot_read_or_write_its_etcd(
    operator: Cluster, ns: str
) -> None:
    c = operator
    host = start_job(c, ns, job("host", PUBLISH_PROGRESS_AND_SLEEP, replicas=1))
    other = start_job(c, ns, job("other", PRINT_ENV_AND_SLEEP, replicas=1))
    # the job's own worker writes over mutual TLS, and the operator reads it so
    wait_for(
        "status.progress from the job's etcd, over mutual TLS",
        lambda: c.status(ns, host).get("progress", {}).get("step") == 1234,
    )
    wait_for(
        "the other job's Secret",
        lambda: c.core.read_namespaced_secret(f"{other}-etcd-client-tls", ns),
    )
    ca = c.core.read_namespaced_secret(f"{host}-etcd-client-tls", ns).data["ca.crt"]
    target = f"{host}-etcd.{ns}.svc:2379"
    intruder = {
        "apiVersion": "v1",
        "kind": "Pod",
        # it wears the host job's worker labels (not a worker index, so the operator does
        # not count it): where NetworkPolicy is enforced (kind) it reaches the etcd as a
        # worker would, and only the missing or foreign certificate stands in its way
        "metadata": {"name": "intruder", "labels": {"app": "intruder", **worker_selector(host)}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,  # the job namespace enforces it
            "containers": [
                {
                    "name": "intruder",
                    "image": RUNTIME_IMAGE,
                    "command": INTRUDE,
                    "securityContext": RESTRICTED_CONTAINER,
                    "env": [
                        {"name": "TARGET", "value": target},
                        {"name": "TARGET_CA", "value": base64.b64decode(ca).decode()},
                    ],
                    "volumeMounts": [{"name": "other", "mountPath": "/other"}],
                }
            ],
            "volumes": [{"name": "other", "secret": {"secretName": f"{other}-etcd-client-tls"}}],
        },
    }
    c.apply(ns, intruder)
    try:

        def seen() -> Obj | None:
            out = c.kubectl("-n", ns, "logs", "intruder", check=False).stdout.strip()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None

        said = wait_for("the intruder's attempts", seen)
    finally:
        c.kubectl("-n", ns, "delete", "pod", "intruder", "--wait=false", check=False)
    # Each refused, in one line naming the endpoint and the setting to check. A TLS alert
    # that a connection reset overtook (the devcluster's Service relay) reads as "etcd
    # closed the TLS connection" with the same advice.
    assert not [case for case, what in said.items() if what.startswith("wrote")], said
    assert said["plain"].startswith(f"EtcdError: etcd at {target}: put /elasticjob/intruder")
    assert said["no-certificate"].startswith(
        (
            f"EtcdTLSError: cannot connect to etcd at {target} over TLS: etcd asks for a "
            "client certificate and none was given",
            f"EtcdError: etcd at {target}: put /elasticjob/intruder failed",
        )
    ), said
    assert "set ELASTICJOB_ETCD_CERT and ELASTICJOB_ETCD_KEY" in said["no-certificate"]
    assert said["another-jobs-certificate"].startswith(
        (
            f"EtcdTLSError: cannot connect to etcd at {target} over TLS: etcd refused",
            f"EtcdError: etcd at {target}: put /elasticjob/intruder failed",
        )
    ), said
    assert (
        "check that --rdzv-conf cert=/other/tls.crt is signed by the CA etcd trusts"
        in said["another-jobs-certificate"]
    )
    assert not [line for line in said.values() if "\n" in line]


def test_rdzv_tls_takes_a_job_to_a_users_etcd_with_the_named_secret(
    operator: Cluster, ns: str
) -> None:
    """The user's etcd here is another job's, which speaks mutual TLS: the guest job names
    it in rdzvEndpoint and its client Secret in rdzvTLS. Its worker writes progress over
    TLS with the mounted Secret, and the operator reads it with the same Secret."""
    c = operator
    host = start_job(c, ns, job("tlshost", PRINT_ENV_AND_SLEEP, replicas=1))
    wait_for(
        "the host's etcd to be available",
        lambda: c.apps.read_namespaced_deployment(f"{host}-etcd", ns).status.available_replicas,
    )
    secret = f"{host}-etcd-client-tls"
    # a user who lends their etcd to a job admits that job's workers to it, as the
    # NetworkPolicy of the host's etcd admits only the host's (where it is enforced)
    c.apply(
        ns,
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{host}-etcd-admits-guest"},
            "spec": {
                "podSelector": {"matchLabels": etcd_selector(host)},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": worker_selector("guest")}}],
                        "ports": [{"protocol": "TCP", "port": contract.DEFAULT_ETCD_PORT}],
                    }
                ],
            },
        },
    )
    guest = start_job(
        c,
        ns,
        job(
            "guest",
            PUBLISH_PROGRESS_AND_SLEEP,
            replicas=1,
            rdzvEndpoint=f"https://{host}-etcd.{ns}.svc:2379",
            rdzvTLS={"secretName": secret},
        ),
    )
    wait_for(
        "the guest's progress, read from the user's etcd with the named Secret",
        lambda: c.status(ns, guest).get("progress", {}).get("step") == 1234,
    )
    pod = c.core.read_namespaced_pod(f"{guest}-worker-0", ns)
    assert {v.secret.secret_name for v in pod.spec.volumes if v.secret} == {secret}
    deployments = {d.metadata.name for d in c.apps.list_namespaced_deployment(ns).items}
    assert f"{guest}-etcd" not in deployments  # the user's etcd, not one of ours
    for name in (f"{guest}-etcd-server-tls", f"{guest}-etcd-client-tls"):
        found = c.core.list_namespaced_secret(ns, field_selector=f"metadata.name={name}").items
        assert not found  # nothing issued for a job that brings its etcd


# Each worker that starts adds one to the step in the job's etcd (over mutual TLS, with
# the certificate mounted from the client Secret) and says the step it wrote.
COUNT_STARTS_AND_SLEEP = [
    "python",
    "-c",
    EXIT_ON_SIGTERM + "import os, time\n"
    "from elasticjob_runtime import contract\n"
    "from elasticjob_runtime.etcd import records\n"
    "from elasticjob_runtime.etcd.tls import connect\n"
    "key = contract.progress_key(os.environ['PET_RDZV_ID'])\n"
    "while True:\n"
    "    try:\n"
    "        e = connect(os.environ['PET_RDZV_ENDPOINT'])\n"
    "        old = e.get(key)\n"
    "        step = records.decode_progress(old.value).step + 1 if old else 1\n"
    "        e.put(key, records.encode_progress(records.Progress(\n"
    "            step=step, world_size=1, samples_per_second=1.0, restart_count=0,\n"
    "            updated=time.time())))\n"
    "        break\n"
    "    except Exception as exc:\n"
    "        print('etcd not ready:', exc, flush=True); time.sleep(0.5)\n"
    "print('wrote step', step, flush=True)\n"
    "time.sleep(3600)\n",
]


def test_a_deleted_client_certificate_secret_is_issued_again_from_the_jobs_ca(
    operator: Cluster, ns: str
) -> None:
    """The CA key kept in the server Secret: a new client certificate, from the same CA,
    for the worker that replaces a deleted one; the job's etcd (not restarted) trusts it."""
    c = operator
    name = start_job(c, ns, job("reissue", COUNT_STARTS_AND_SLEEP, replicas=1))
    secret, pod = f"{name}-etcd-client-tls", f"{name}-worker-0"
    wait_for(
        "step 1 from the first worker",
        lambda: c.status(ns, name).get("progress", {}).get("step") == 1,
    )
    uid = c.job(ns, name)["metadata"]["uid"]
    first = c.core.read_namespaced_secret(secret, ns)
    etcd_selector = f"elastic.pytorch.org/job-name={name},elastic.pytorch.org/replica-type=etcd"
    etcd_pods = [
        p.metadata.uid for p in c.core.list_namespaced_pod(ns, label_selector=etcd_selector).items
    ]
    assert len(etcd_pods) == 1
    old_pod = c.core.read_namespaced_pod(pod, ns).metadata.uid
    c.kubectl("-n", ns, "delete", "secret", secret)
    c.kubectl("-n", ns, "delete", "pod", pod, "--wait=false")
    again = wait_for(
        "the client Secret issued again",
        lambda: c.core.list_namespaced_secret(ns, field_selector=f"metadata.name={secret}").items,
    )[0]
    owner = again.metadata.owner_references[0]
    assert (owner.uid, owner.controller) == (uid, True)
    data = {k: base64.b64decode(v) for k, v in again.data.items()}
    assert set(data) == {"ca.crt", "tls.crt", "tls.key"}  # never the CA key
    assert data["ca.crt"] == base64.b64decode(first.data["ca.crt"])
    assert data["tls.crt"] != base64.b64decode(first.data["tls.crt"])
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    verified = (
        PolicyBuilder()
        .store(Store([ca]))
        .build_client_verifier()
        .verify(x509.load_pem_x509_certificate(data["tls.crt"]), [])
    )
    assert verified.chain[-1] == ca
    # the replacement worker mounts it and reaches the same etcd, which has not restarted
    wait_for(
        "step 2 from the replacement worker",
        lambda: c.status(ns, name).get("progress", {}).get("step") == 2,
    )
    assert c.core.read_namespaced_pod(pod, ns).metadata.uid != old_pod
    etcd_now = c.core.list_namespaced_pod(ns, label_selector=etcd_selector).items
    assert [p.metadata.uid for p in etcd_now] == etcd_pods


def test_no_certificate_or_key_in_the_operators_log_or_the_jobs_events_or_status(
    operator: Cluster, ns: str
) -> None:
    c = operator
    name = start_job(c, ns, job("quiet", PUBLISH_PROGRESS_AND_SLEEP, replicas=2))
    wait_for(
        "status.progress (the operator has read the job's etcd with its client certificate)",
        lambda: c.status(ns, name).get("progress", {}).get("step") == 1234,
    )
    time.sleep(RESYNC + 1)  # a resync later: the certificates have been read more than once
    selector = f"involvedObject.name={name}"
    events = c.core.list_namespaced_event(ns, field_selector=selector).items
    assert {e.reason for e in events} >= {"ProvisionedEtcd", "CreatedWorkers"}
    log = operator_log(c)
    assert f"{ns}/{name}" in log  # the log that is scanned is the one for this job
    texts = {
        "the operator's log": log,
        "the job's events": json.dumps([(e.reason, e.message) for e in events]),
        "the job's status": json.dumps(c.status(ns, name)),
        "kubectl describe": c.kubectl("-n", ns, "describe", "elasticjob", name).stdout,
    }
    for where, text in texts.items():
        for marker in ("PRIVATE KEY", "BEGIN CERTIFICATE", "LS0tLS1CRUdJT"):  # and base64
            assert marker not in text, f"{marker!r} in {where}"


# A worker whose checkpoint does not fit its /dev/shm: the runtime's CheckpointManager
# (local rank 0 of every pod writes the node-memory copy) reports it to the job's etcd.
SAVE_TOO_BIG_AND_SLEEP = [
    "python",
    "-c",
    "import os, tempfile, time, torch\n"
    "from elasticjob_runtime.checkpoints.manager import CheckpointManager\n"
    "from elasticjob_runtime.etcd.tls import connect\n"
    "s = os.statvfs('/dev/shm')\n"
    "print(f'shm={s.f_blocks * s.f_frsize}', flush=True)\n"
    "e = connect(os.environ['PET_RDZV_ENDPOINT'])\n"
    "while True:  # a real save comes after the rendezvous, so after etcd is up\n"
    "    try:\n"
    "        e.check(); break\n"
    "    except Exception as exc:\n"
    "        print('etcd not ready:', exc, flush=True); time.sleep(0.5)\n"
    "ckpt = CheckpointManager(tempfile.mkdtemp(), writer=True, memory_writer=True)\n"
    "for step in (1, 2):\n"
    "    ckpt.save({'w': torch.zeros(1 << 19)}, step)  # 2 MiB\n"
    "print('saved', flush=True)\n"
    "time.sleep(3600)\n",
]


def test_a_checkpoint_too_big_for_dev_shm_is_one_warning_event(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("shm", SAVE_TOO_BIG_AND_SLEEP, replicas=2, shmSize="1Mi"))
    pod = wait_for("a worker pod", lambda: c.workers(ns, name).get("shm-worker-0"))
    assert {"name": "elasticjob-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in [
        c.core.api_client.sanitize_for_serialization(v) for v in pod.spec.volumes
    ]

    def logs() -> str:
        return str(c.kubectl("-n", ns, "logs", "shm-worker-0", check=False).stdout)

    wait_for("the worker to save", lambda: "saved" in logs())
    assert f"shm={1 << 20}" in logs()  # the pod's /dev/shm is the spec's, not 64 MiB

    def said() -> Obj | None:
        return c.status(ns, name).get("nodeMemoryFallback")

    try:
        fallback = wait_for("status.nodeMemoryFallback", said)
    except AssertionError as e:  # the worker's own words say whether it saw the fault
        raise AssertionError(f"{e}\n--- shm-worker-0 ---\n{logs()[-3000:]}") from None
    assert fallback["runId"] == c.job(ns, name)["metadata"]["uid"]
    time.sleep(RESYNC + 1)  # a resync later: the operator does not say it again

    def events() -> list[Any]:
        selector = f"involvedObject.name={name},reason=CheckpointNotInNodeMemory"
        return list(c.core.list_namespaced_event(ns, field_selector=selector).items)

    [event] = events()
    assert event.type == "Warning" and (event.count or 1) == 1
    assert event.message == fallback["message"]
    assert "does not fit in a /dev/shm of 1 MiB" in event.message
    assert "raise spec.shmSize (1Mi) to at least 256Mi" in event.message


def running_condition(status: Obj) -> Obj:
    return next(x for x in status.get("conditions", []) if x["type"] == "Running")


def test_a_worker_the_kubelet_cannot_start_shows_on_the_job(operator: Cluster, ns: str) -> None:
    """A worker whose env names a Secret that does not exist waits in
    CreateContainerConfigError: the job says so in its Running condition and in one
    Warning event, and starts once the Secret is there."""
    c = operator
    spec = job("stuck", PRINT_ENV_AND_SLEEP, replicas=1)
    [container] = spec["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    secret_ref = {"secretKeyRef": {"name": "stuck-token", "key": "token"}}
    container["env"] = [{"name": "HF_TOKEN", "valueFrom": secret_ref}]
    name = start_job(c, ns, spec)
    said = (
        "stuck-worker-0: CreateContainerConfigError (container trainer): "
        'secret "stuck-token" not found'
    )

    def events() -> list[Any]:
        selector = f"involvedObject.kind=ElasticJob,involvedObject.name={name},reason=WorkerStuck"
        return list(c.core.list_namespaced_event(ns, field_selector=selector).items)

    [event] = wait_for("the WorkerStuck event", events)
    assert event.type == "Warning"
    assert event.message.startswith(f"worker pod {said}; "), event.message
    # the round posts its events before it writes the status (Kube.apply): wait for it
    running = wait_for(
        "the Running condition to name the stuck worker",
        lambda: (r := running_condition(c.status(ns, name)))["message"].endswith(said) and r,
    )
    assert (running["status"], running["reason"]) == ("False", "WaitingForWorkers")
    assert running["message"] == f"0 of 1 workers running (minReplicas 1); {said}"
    [stuck] = c.status(ns, name)["stuckWorkers"]
    assert (stuck["pod"], stuck["reason"]) == ("stuck-worker-0", "CreateContainerConfigError")
    time.sleep(6)  # resyncs (every 2 s) see the same pod: nothing said again
    [again] = events()
    assert (again.metadata.name, again.count or 1) == (event.metadata.name, 1)

    secret = {"metadata": {"name": "stuck-token"}, "stringData": {"token": "t0ken"}}
    c.core.create_namespaced_secret(ns, secret)
    wait_for(
        "the worker to start and the Running condition to say only the count",
        lambda: (
            running_condition(c.status(ns, name))["message"]
            == "1 of 1 workers running (minReplicas 1)"
        ),
    )
    assert c.status(ns, name)["stuckWorkers"] == [stuck]  # kept while the pod exists


def test_kubectl_scale_changes_the_worker_count(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("scale", PRINT_ENV_AND_SLEEP, replicas=1))
    wait_for("1 running worker", lambda: len(c.running_workers(ns, name)) == 1)
    c.kubectl("-n", ns, "scale", f"elasticjob/{name}", "--replicas=3")
    wait_for(
        "3 running workers",
        lambda: (
            sorted(c.running_workers(ns, name))
            == ["scale-worker-0", "scale-worker-1", "scale-worker-2"]
        ),
    )
    wait_for(
        "status to count 3 active",
        lambda: c.status(ns, name)["replicaStatuses"]["Worker"]["active"] == 3,
    )
    # what an HPA reads: the scale subresource with replicas and the pods' selector
    scale = json.loads(
        c.kubectl(
            "get",
            "--raw",
            f"/apis/elastic.pytorch.org/v1alpha1/namespaces/{ns}/elasticjobs/{name}/scale",
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    selected = c.core.list_namespaced_pod(ns, label_selector=scale["status"]["selector"]).items
    assert sorted(p.metadata.name for p in selected) == sorted(c.workers(ns, name))
    c.kubectl("-n", ns, "scale", f"elasticjob/{name}", "--replicas=2")
    wait_for(
        "worker 2 gone", lambda: sorted(c.workers(ns, name)) == ["scale-worker-0", "scale-worker-1"]
    )
    refused = c.kubectl("-n", ns, "scale", f"elasticjob/{name}", "--replicas=9", check=False)
    assert refused.returncode != 0
    assert "spec.replicaSpecs.Worker.replicas must not exceed spec.maxReplicas" in refused.stderr
    status = c.status(ns, name)
    assert status["restartCount"] == 0 and status["replicaStatuses"]["Worker"]["failed"] == 0


def test_a_deleted_worker_pod_is_replaced_and_counted(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("heal", PRINT_ENV_AND_SLEEP, replicas=2))
    wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
    old_uid = c.core.read_namespaced_pod("heal-worker-0", ns).metadata.uid
    c.kubectl("-n", ns, "delete", "pod", "heal-worker-0", "--wait=false")
    wait_for(
        "a new heal-worker-0",
        lambda: (
            (p := c.running_workers(ns, name).get("heal-worker-0")) is not None
            and p.metadata.uid != old_uid
        ),
    )
    wait_for("restartCount 1", lambda: c.status(ns, name).get("restartCount") == 1)
    events = c.kubectl("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")
    assert "RestartingWorker" in events.stdout


def test_an_evicted_worker_is_replaced_without_spending_the_backoff_limit(
    operator: Cluster, ns: str
) -> None:
    """The eviction API (what `kubectl drain` calls) marks the pod DisruptionTarget: the
    cluster took it, the worker did not fail, so backoffLimit 0 is not spent by it."""
    c = operator
    name = start_job(c, ns, job("evict", PRINT_ENV_AND_SLEEP, replicas=2, backoffLimit=0))
    wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
    old_uid = c.core.read_namespaced_pod("evict-worker-0", ns).metadata.uid
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "evict-worker-0", "namespace": ns},
    }
    c.kubectl(
        "create",
        "--raw",
        f"/api/v1/namespaces/{ns}/pods/evict-worker-0/eviction",
        "-f",
        "-",
        input=json.dumps(eviction),
    )
    try:
        wait_for(
            "a new evict-worker-0",
            lambda: (
                (p := c.running_workers(ns, name).get("evict-worker-0")) is not None
                and p.metadata.uid != old_uid
            ),
        )
    except AssertionError as exc:  # once, in a full run, no replacement came in 180 s
        pods = c.kubectl("-n", ns, "get", "pods", "-o", "wide", check=False).stdout
        raise AssertionError(
            f"{exc}\n--- status\n{c.status(ns, name)}\n--- pods\n{pods}\n{operator_log(c)[-6000:]}"
        ) from exc
    status = c.status(ns, name)
    assert status.get("phase") != "Failed", status
    assert status["restartCount"] == 0 and status["replicaStatuses"]["Worker"]["failed"] == 0
    events = c.kubectl("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")
    assert "ReplacingDisruptedWorker" in events.stdout, events.stdout


def test_a_disruption_budget_refuses_an_eviction_below_min_replicas(
    operator: Cluster, ns: str
) -> None:
    """With spec.podDisruptionBudget, kubectl drain cannot take the job below minReplicas:
    the API server refuses the eviction (429) and the worker stays."""
    c = operator
    doc = job("guarded", PRINT_ENV_AND_SLEEP, replicas=2, podDisruptionBudget=True)
    doc["spec"]["minReplicas"] = 2
    name = start_job(c, ns, doc)
    wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
    wait_for(
        "the budget to count both workers healthy",
        lambda: (
            c.kubectl("-n", ns, "get", "pdb", "guarded-workers", "-o", "json", check=False).stdout
            and json.loads(
                c.kubectl("-n", ns, "get", "pdb", "guarded-workers", "-o", "json").stdout
            )
            .get("status", {})
            .get("currentHealthy")
            == 2
        ),
    )
    uid = c.core.read_namespaced_pod("guarded-worker-0", ns).metadata.uid
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "guarded-worker-0", "namespace": ns},
    }
    refused = c.kubectl(
        "create",
        "--raw",
        f"/api/v1/namespaces/{ns}/pods/guarded-worker-0/eviction",
        "-f",
        "-",
        input=json.dumps(eviction),
        check=False,
    )
    assert refused.returncode != 0 and "disruption budget" in refused.stderr, refused.stderr
    assert c.core.read_namespaced_pod("guarded-worker-0", ns).metadata.uid == uid


def test_restarting_the_operator_changes_nothing_that_runs(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("steady", PRINT_ENV_AND_SLEEP, replicas=2))

    def settled() -> bool:
        conds = {x["type"]: x for x in c.status(ns, name).get("conditions", [])}
        running = conds.get("Running", {})
        return running.get("status") == "True" and "2 of 2" in running.get("message", "")

    wait_for("both workers running", settled)
    before = {n: p.metadata.uid for n, p in c.workers(ns, name).items()}

    def certificates() -> dict[str, tuple[str, str]]:
        names = ("steady-etcd-server-tls", "steady-etcd-client-tls")
        found = {n: c.core.read_namespaced_secret(n, ns).metadata for n in names}
        return {n: (m.uid, m.resource_version) for n, m in found.items()}

    certificates_before = certificates()
    status_before = c.status(ns, name)
    old_ops = {p.metadata.uid for p in operator_pods(c)}
    c.kubectl("-n", OP_NS, "delete", "pod", "-l", "app.kubernetes.io/name=elasticjob-operator")
    wait_for(
        "a new operator pod to run",
        lambda: [p for p in operator_pods(c, running=True) if p.metadata.uid not in old_ops],
    )
    time.sleep(2 * RESYNC)  # resyncs of the new operator
    after = {n: p.metadata.uid for n, p in c.workers(ns, name).items()}
    assert after == before
    assert certificates() == certificates_before  # reused, never issued again
    status_after = c.status(ns, name)
    for key in ("restartCount", "incarnation", "startTime", "replicaStatuses", "conditions"):
        assert status_after.get(key) == status_before.get(key), key


def test_suspend_deletes_the_workers_and_resume_starts_a_new_run(
    operator: Cluster, ns: str
) -> None:
    c = operator
    name = start_job(c, ns, job("pause", PRINT_ENV_AND_SLEEP, replicas=2))
    uid = c.job(ns, name)["metadata"]["uid"]
    wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
    c.kubectl(
        "-n", ns, "patch", "elasticjob", name, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    wait_for("no workers", lambda: not c.workers(ns, name) or None, timeout=WAIT)
    wait_for("phase Suspended", lambda: c.status(ns, name).get("phase") == "Suspended")
    assert c.job(ns, name)  # the job is kept
    c.kubectl(
        "-n", ns, "patch", "elasticjob", name, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    wait_for("2 running workers again", lambda: len(c.running_workers(ns, name)) == 2)
    pod = c.core.read_namespaced_pod("pause-worker-0", ns)
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env[contract.RDZV_ID] == f"{uid}-1"


def test_deleting_the_job_removes_every_child(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("gone", PRINT_ENV_AND_SLEEP, replicas=2))
    wait_for("2 running workers", lambda: len(c.running_workers(ns, name)) == 2)
    wait_for("the etcd Deployment", lambda: c.apps.read_namespaced_deployment("gone-etcd", ns))
    c.kubectl("-n", ns, "delete", "elasticjob", name, "--wait=true", "--timeout=120s")

    def nothing_left() -> bool:
        sel = "elastic.pytorch.org/job-name=gone"
        return not (
            c.core.list_namespaced_pod(ns, label_selector=sel).items
            or c.core.list_namespaced_service(ns, label_selector=sel).items
            or c.apps.list_namespaced_deployment(ns, label_selector=sel).items
            or c.apps.list_namespaced_replica_set(ns, label_selector=sel).items
            or c.core.list_namespaced_secret(ns, label_selector=sel).items
        )

    wait_for("every child of the job to be gone", nothing_left)


def wait_finished(c: Cluster, ns: str, name: str, timeout: float = WAIT) -> Obj:
    return wait_for(
        f"{name} to succeed or fail",
        lambda: (s := c.status(ns, name)).get("phase") in ("Succeeded", "Failed") and s,
        timeout=timeout,
    )


def exit_on_worker_1(code: int) -> list[str]:
    """Worker 1 exits with `code` at once; the others run until deleted."""
    return [
        "python",
        "-c",
        "import os, sys, time\n"
        f"if os.environ['ELASTICJOB_POD_NAME'].endswith('-1'): sys.exit({code})\n"
        "time.sleep(3600)\n",
    ]


def test_exit_code_policy_fails_on_a_permanent_error_then_ttl_deletes_the_job(
    operator: Cluster, ns: str
) -> None:
    c = operator
    spec = job("perm", exit_on_worker_1(3), replicas=2, ttlSecondsAfterFinished=8)
    spec["spec"]["replicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    name = start_job(c, ns, spec)
    status = wait_finished(c, ns, name)
    assert status["phase"] == "Failed", status
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "PermanentError"
    assert "perm-worker-1 failed with exit code 3" in failed["message"]
    assert status["restartCount"] == 0
    # cleanPodPolicy Running (the default): the running worker goes, the failed one stays
    wait_for("worker 0 deleted", lambda: "perm-worker-0" not in c.workers(ns, name))
    assert c.core.read_namespaced_pod("perm-worker-1", ns).status.phase == "Failed"
    wait_for(
        "the job deleted by its TTL",
        lambda: c.kubectl("-n", ns, "get", "elasticjob", name, check=False).returncode != 0,
        timeout=60,
    )


def test_retryable_failures_are_replaced_until_the_backoff_limit(
    operator: Cluster, ns: str
) -> None:
    c = operator
    spec = job("flaky", exit_on_worker_1(137), replicas=2, backoffLimit=2)
    spec["spec"]["replicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    name = start_job(c, ns, spec)
    status = wait_finished(c, ns, name)
    assert status["phase"] == "Failed", status
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert status["restartCount"] == 2
    assert status["replicaStatuses"]["Worker"]["failed"] == 3
    described = c.kubectl("-n", ns, "describe", "elasticjob", name).stdout
    assert "exit code 137; deleting it to replace it" in described
    # the same decision twice is one Event counted twice, as kubelet's recorder does
    events = c.core.list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name},reason=RestartingWorker"
    ).items
    assert [e.count for e in events] == [2], [(e.message, e.count) for e in events]


def test_never_policy_carries_on_then_fails_below_min_after_the_grace(
    operator: Cluster, ns: str
) -> None:
    c = operator
    spec = job("thin", exit_on_worker_1(1), replicas=2)
    spec["spec"]["minReplicas"] = 2
    spec["spec"]["replicaSpecs"]["Worker"]["restartPolicy"] = "Never"
    name = start_job(c, ns, spec)
    wait_for(
        "worker 1 retired",
        lambda: c.status(ns, name).get("workerIndexes", {}).get("retired") == [1],
    )
    assert not any(
        x["type"] == "Failed" for x in c.status(ns, name).get("conditions", [])
    )  # within the grace the job goes on
    status = wait_finished(c, ns, name, timeout=BELOW_MIN_GRACE + WAIT)
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "BelowMinReplicas", status
    assert status["restartCount"] == 0  # Never: nothing was replaced


def test_active_deadline_fails_the_job_and_stops_its_workers(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("late", PRINT_ENV_AND_SLEEP, replicas=2, activeDeadlineSeconds=8))
    status = wait_finished(c, ns, name)
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded", status
    wait_for("the workers stopped", lambda: not c.workers(ns, name) or None)


def test_metrics_are_scrapeable_through_the_charts_service(operator: Cluster, ns: str) -> None:
    c = operator
    name = start_job(c, ns, job("metered", PRINT_ENV_AND_SLEEP, replicas=1))
    wait_for("phase Running", lambda: c.status(ns, name).get("phase") == "Running")
    url = f"http://{FULLNAME}-metrics.{OP_NS}.svc:8000/metrics"
    scraper = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "scrape"},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,
            "containers": [
                {
                    "name": "scrape",
                    "image": RUNTIME_IMAGE,
                    "securityContext": RESTRICTED_CONTAINER,
                    "command": [
                        "python",
                        "-c",
                        "import time, urllib.request\n"
                        "time.sleep(5)  # two resyncs after the job runs\n"
                        f"print(urllib.request.urlopen('{url}', timeout=30).read().decode())\n",
                    ],
                }
            ],
        },
    }
    c.apply(ns, scraper)
    wait_for(
        "the scrape to finish",
        lambda: c.core.read_namespaced_pod("scrape", ns).status.phase in ("Succeeded", "Failed"),
    )
    body = c.kubectl("-n", ns, "logs", "scrape").stdout
    running = re.search(r'^elasticjob_jobs\{phase="Running"\} (\S+)$', body, re.M)
    assert running is not None and float(running.group(1)) >= 1, body[-3000:]
    count = re.search(r"^elasticjob_reconcile_duration_seconds_count (\S+)$", body, re.M)
    assert count is not None and float(count.group(1)) > 0
    c.kubectl("-n", ns, "delete", "pod", "scrape", "--wait=false")


# -- validation ------------------------------------------------------------------------------


def test_malformed_manifests_are_refused_naming_the_field(operator: Cluster, ns: str) -> None:
    base = job("bad", ["true"])
    assert operator.apply(ns, base, check=False).returncode == 0  # the base is fine
    operator.kubectl("-n", ns, "delete", "elasticjob", "bad", "--wait=false")
    assert len(MALFORMED) >= 15
    wrong = []
    for case, edit, text in MALFORMED:
        out = operator.apply(ns, malformed(base, edit), check=False)
        if out.returncode == 0 or text not in out.stderr:
            wrong.append(f"{case}: rc={out.returncode} {out.stderr.strip()[:300]}")
    assert not wrong, "\n".join(wrong)


def test_api_server_and_the_models_agree_on_what_is_valid(operator: Cluster, ns: str) -> None:
    """The CRD is generated from the models: for a spread of specs, the API server (CEL +
    OpenAPI) accepts exactly those the pydantic models accept."""
    from pydantic import ValidationError

    from elasticjob_operator.models import ElasticJobSpec

    rng = random.Random(4)
    disagree = []
    verdicts = []
    for i in range(40):
        obj = job(f"agree-{i}", ["true"], replicas=rng.randint(0, 6))
        spec = obj["spec"]
        spec["minReplicas"] = rng.randint(0, 5)
        spec["maxReplicas"] = rng.choice([rng.randint(1, 6), None])
        if spec["maxReplicas"] is None:
            del spec["maxReplicas"]
        spec["nprocPerNode"] = rng.choice([0, 1, 4, "auto", "gpu", "two"])
        spec["rdzvBackend"] = rng.choice(["etcd-v3", "c10d", "etcd"])
        if rng.random() < 0.5:
            spec["rdzvEndpoint"] = rng.choice(["etcd:2379", "etcd", "a.b.c:1,d:2", "http://e:2379"])
        if rng.random() < 0.3:
            spec["etcd"] = {"image": "etcd:x"}
        if rng.random() < 0.3:
            spec["shmSize"] = rng.choice(["512Mi", "0", "1.5Gi", "2GB", "-1Gi", "8e9"])
        try:
            ElasticJobSpec.model_validate(spec)
            models_ok = True
        except ValidationError:
            models_ok = False
        out = operator.kubectl(
            "-n", ns, "apply", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False
        )
        verdicts.append(models_ok)
        if (out.returncode == 0) != models_ok:
            disagree.append(f"{json.dumps(spec)}: models {models_ok}, API server {out.stderr}")
    assert not disagree, "\n".join(disagree)
    assert verdicts.count(True) >= 5 and verdicts.count(False) >= 5  # both sides exercised


# -- the archived controller's manifest --------------------------------------------------------

ETCD_SERVICE = [
    {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "etcd-service"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "etcd-service"}},
            "template": {
                "metadata": {"labels": {"app": "etcd-service"}},
                "spec": {
                    "securityContext": RESTRICTED_POD,  # the job namespace enforces it
                    "containers": [
                        {
                            "name": "etcd",
                            "image": "quay.io/coreos/etcd:v3.6.16",
                            "env": [
                                {
                                    "name": "POD_IP",
                                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                                }
                            ],
                            "command": [
                                "etcd",
                                "--data-dir=/var/lib/etcd",
                                "--listen-client-urls=http://$(POD_IP):2379",
                                "--advertise-client-urls=http://etcd-service:2379",
                                "--listen-peer-urls=http://127.0.0.1:2380",
                            ],
                            "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                            "securityContext": RESTRICTED_CONTAINER,
                        }
                    ],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    },
    {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "etcd-service"},
        "spec": {
            "selector": {"app": "etcd-service"},
            "ports": [{"port": 2379, "targetPort": 2379}],
        },
    },
]

# The archived example's workers ran torchelastic's launcher; ours run elasticjob-run
# (torchrun with the etcd-v3 rendezvous), which reads what the operator injects
# (PET_RDZV_ENDPOINT = the user's etcd, PET_RDZV_ID, PET_NNODES = 1:2). Each rank joins a
# gloo process group, all-reduces a one and prints the world size and the sum.
TRAIN_WITH_TORCHRUN = [
    "elasticjob-run",
    "--no-python",
    "python",
    "-c",
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "print('world', dist.get_world_size(), 'sum', int(t.item()), flush=True)\n"
    "dist.destroy_process_group()\n",
]


def users_etcd(c: Cluster, ns: str) -> None:
    """The archived example's etcd-service, running (an earlier test's is reused)."""
    for obj in ETCD_SERVICE:
        c.apply(ns, obj)
    wait_for(
        "the user's etcd",
        lambda: c.apps.read_namespaced_deployment("etcd-service", ns).status.available_replicas,
    )


def test_archived_controller_manifest_applies_and_runs(operator: Cluster, ns: str) -> None:
    c = operator
    users_etcd(c, ns)
    name = start_job(c, ns, archived("imagenet", "etcd-service:2379", TRAIN_WITH_TORCHRUN))
    status = wait_finished(c, ns, name, timeout=300)
    assert status["phase"] == "Succeeded", status
    assert status["replicaStatuses"]["Worker"]["succeeded"] == 2
    assert "completionTime" in status
    deployments = c.apps.list_namespaced_deployment(ns).items
    assert "imagenet-etcd" not in {d.metadata.name for d in deployments}  # the user's etcd
    for i in (0, 1):
        logs = c.kubectl("-n", ns, "logs", f"imagenet-worker-{i}").stdout
        world = re.search(r"world (\d) sum (\d)", logs)
        assert world is not None, logs[-2000:]
        # the job asked for 2: both train, together, even where worker-1's pod starts
        # seconds later (the first round waits for it: docs/rendezvous.md)
        assert world.groups() == ("2", "2"), logs[-2000:]
    waited = c.kubectl(
        "-n", ns, "wait", f"elasticjob/{name}", "--for=condition=Succeeded", "--timeout=10s"
    )
    assert waited.returncode == 0


# The archived imagenet.yaml gave the launcher's arguments only (`args`, no `command`): the
# image's ENTRYPOINT ran them. The runtime image's ENTRYPOINT is elasticjob-run, which the
# devcluster runs too (container_images.py); here it trains the ImageNet-style example a
# few steps.
TRAIN_IMAGENET_ARGS = [
    "--nproc-per-node=1",
    "-m",
    "elasticjob_examples.imagenet",
    "--epochs=1",
    "--batch-size=16",
    "--max-steps=6",
    "--synthetic-size=256",
    "--print-freq=2",
    "--checkpoint-dir=/checkpoints",
]


def test_an_args_only_archived_manifest_of_the_runtime_image_trains(
    operator: Cluster, ns: str
) -> None:
    c = operator
    users_etcd(c, ns)
    manifest = archived_args_only("argsonly", "etcd-service:2379", TRAIN_IMAGENET_ARGS)
    name = start_job(c, ns, manifest)
    pod = wait_for("a worker pod", lambda: c.workers(ns, name).get("argsonly-worker-0"))
    [container] = pod.spec.containers
    assert container.command is None and container.args == TRAIN_IMAGENET_ARGS
    status = wait_finished(c, ns, name, timeout=400)
    logs = {i: c.kubectl("-n", ns, "logs", f"argsonly-worker-{i}").stdout for i in (0, 1)}
    assert status["phase"] == "Succeeded", (status, {i: t[-2000:] for i, t in logs.items()})
    results = [
        json.loads(line.split(" ", 1)[1])
        for text in logs.values()
        for line in text.splitlines()
        if line.startswith("ELASTICJOB_RESULT ")
    ]
    assert results and all(r["steps"] == 6 for r in results), results
    assert any("step=6 " in text for text in logs.values())
