"""The chart's shared etcd (``sharedEtcd.enabled``) on a real cluster: the example
trains through it to success, a job's certificate opens none of another job's keys, and
a deleted job's certificate opens nothing at all.

One helm release for the module, with one etcd for every job; the operator issues its
certificates, switches etcd's authentication on and gives each job its user.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from elasticjob_manifests import PUBLISH_PROGRESS_AND_SLEEP, RUNTIME_IMAGE, job
from kube_helpers import (
    AWAIT_TARGET,
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    Cluster,
    Obj,
    Operator,
    installed_operator,
    wait_for,
)
from training_logs import TRAIN, delete_jobs, job_starter, manifest, unique

from elasticjob_runtime import contract

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(kubeconfig: Path) -> Cluster:
    return Cluster(kubeconfig)


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Operator]:
    with installed_operator(cluster, "es", "--set", "sharedEtcd.enabled=true") as op:
        yield op


@pytest.fixture
def ns(installed: Operator) -> Iterator[str]:
    yield installed.job_namespace
    delete_jobs(installed.cluster, installed.job_namespace)


def _shared_endpoint(op: Operator) -> str:
    return f"https://{op.fullname}-etcd.{op.namespace}.svc:{contract.DEFAULT_ETCD_PORT}"


def test_the_example_trains_through_the_shared_etcd(installed: Operator, ns: str) -> None:
    c = installed.cluster
    name = unique("shared")
    with job_starter(c, ns) as start:
        start(manifest(name, TRAIN_STEPS=40, TRAIN_SLEEP=0, TRAIN_LOG_EVERY=10))
        waited = c.kubectl(
            "-n",
            ns,
            "wait",
            f"elasticjob/{name}",
            "--for=condition=Succeeded",
            f"--timeout={int(TRAIN)}s",
            check=False,
        )
        assert waited.returncode == 0, (
            waited.stderr + c.kubectl("-n", ns, "describe", "elasticjob", name).stdout
        )
    # no etcd of its own: no Deployment, no server Secret; its workers went to the shared one
    deployments = c.kubectl("-n", ns, "get", "deployments", "-o", "name").stdout
    assert f"{name}-etcd" not in deployments
    secrets = c.kubectl("-n", ns, "get", "secrets", "-o", "name").stdout
    assert f"{name}-etcd-server-tls" not in secrets and f"{name}-etcd-client-tls" in secrets
    pod = c.core.read_namespaced_pod(f"{name}-worker-0", ns)
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env[contract.RDZV_ENDPOINT] == _shared_endpoint(installed)
    # the shared etcd's Secret, in the operator's namespace, holds what the operator issued
    shared = c.core.read_namespaced_secret(f"{installed.fullname}-etcd-tls", installed.namespace)
    assert {"ca.crt", "ca.key", "tls.crt", "tls.key", "root-password"} <= set(shared.data)


def test_the_operator_mirrors_progress_it_reads_from_the_shared_etcd(
    installed: Operator, ns: str
) -> None:
    """Read as root, by token: the JSON gateway takes no user from a certificate."""
    c = installed.cluster
    name = unique("progress")
    c.apply(ns, job(name, PUBLISH_PROGRESS_AND_SLEEP, replicas=2))
    status = wait_for(
        "status.progress from the shared etcd",
        lambda: (s := c.status(ns, name)).get("progress", {}).get("step") == 1234 and s,
    )
    assert status["progress"]["worldSize"] == 2


# A pod holding a job's certificate (given in its environment) tries its own job's
# progress key and another job's, and prints one JSON line: key -> what happened.
TRY_KEYS = [
    "python",
    "-c",
    AWAIT_TARGET + "import json, os, pathlib\n"
    "from elasticjob_runtime.etcd.tls import connect\n"
    "for f in ('ca.crt', 'tls.crt', 'tls.key'):\n"
    "    pathlib.Path('/tmp', f).write_text(os.environ[f.replace('.', '_').upper()])\n"
    "conf = {'cacert': '/tmp/ca.crt', 'cert': '/tmp/tls.crt', 'key': '/tmp/tls.key'}\n"
    "seen = {}\n"
    "for key in os.environ['KEYS'].split(','):\n"
    "    try:\n"
    "        e = connect(os.environ['TARGET'], conf, env={}, timeout=5)\n"
    "        e.put(key, b'x')\n"
    "        seen[key] = 'wrote'\n"
    "    except Exception as exc:\n"
    "        seen[key] = f'{type(exc).__name__}: {exc}'\n"
    "print(json.dumps(seen), flush=True)\n",
]


def _try_keys(c: Cluster, ns: str, target: str, secret: Obj, keys: list[str]) -> dict[str, str]:
    name = unique("try")
    env = [{"name": "TARGET", "value": target}, {"name": "KEYS", "value": ",".join(keys)}]
    for key in ("ca.crt", "tls.crt", "tls.key"):
        value = base64.b64decode(secret[key]).decode()
        env.append({"name": key.replace(".", "_").upper(), "value": value})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,
            "containers": [
                {
                    "name": "try",
                    "image": RUNTIME_IMAGE,
                    "command": TRY_KEYS,
                    "securityContext": RESTRICTED_CONTAINER,
                    "env": env,
                    # the shared etcd admits the watched namespaces' worker pods only
                    # (NetworkPolicy): this one poses as one, holding a job's certificate
                }
            ],
        },
    }
    pod["metadata"]["labels"] = {"elastic.pytorch.org/replica-type": "worker"}
    c.apply(ns, pod)
    try:

        def seen() -> dict[str, str] | None:
            out = c.kubectl("-n", ns, "logs", name, check=False).stdout.strip()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None

        said: dict[str, str] = wait_for("the pod's attempts", seen)
        return said
    finally:
        c.kubectl("-n", ns, "delete", "pod", name, "--wait=false", check=False)


SLEEP = ["python", "-c", "import time; time.sleep(3600)"]


def test_a_jobs_certificate_opens_its_own_keys_only_and_nothing_once_it_is_deleted(
    installed: Operator, ns: str
) -> None:
    c = installed.cluster
    a, b = unique("a"), unique("b")
    for name in (a, b):
        c.apply(ns, job(name, SLEEP, replicas=1))
    uids: dict[str, str] = {}
    secrets: dict[str, Any] = {}
    for name in (a, b):
        secrets[name] = wait_for(
            f"{name}'s client Secret",
            lambda n=name: c.core.read_namespaced_secret(f"{n}-etcd-client-tls", ns).data,
        )
        uids[name] = c.job(ns, name)["metadata"]["uid"]
    target = _shared_endpoint(installed)
    own, theirs = contract.progress_key(uids[a]), contract.progress_key(uids[b])
    said = _try_keys(c, ns, target, secrets[a], [own, theirs])
    assert said[own] == "wrote", said
    assert "permission denied" in said[theirs], said
    # deleted: its user goes (the operator's DELETED handler); its certificate opens nothing
    c.kubectl("-n", ns, "delete", "elasticjob", a, "--wait=true", "--timeout=120s")

    def refused() -> dict[str, str] | None:
        now = _try_keys(c, ns, target, secrets[a], [own])
        return now if now[own] != "wrote" else None

    said = wait_for("the deleted job's certificate to be refused", refused)
    assert "EtcdError" in said[own], said
