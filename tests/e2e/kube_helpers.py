"""What the e2e modules share: kubectl/helm as a user runs them, bounded waits, and the
operator installed from the chart with helm into namespaces of its own.

Each module installs its own release (unique names, the operator watching only its job
namespace through namespaced Roles), so modules can share one cluster. The devcluster
and another cluster differ only in what the environment hands over:
ELASTICJOB_E2E_KUBECONFIG (conftest.py), ELASTICJOB_E2E_HELM_ARGS (extra `helm install`
arguments, e.g. the operator image kind was loaded with) and ELASTICJOB_E2E_RUNTIME_IMAGE
(the workers' image; the devcluster runs commands from this checkout's environment and
ignores images).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

# Python a test pod runs before it tries TARGET (host:port, or an endpoint with a scheme):
# wait, up to 60 s, until it accepts a TCP connection from this pod. Where NetworkPolicy
# is enforced (kind's kube-router) a new pod's address joins the policy's set a moment
# after the pod starts, and until then its connections are refused; a test about what
# etcd says to a certificate must not read that refusal as etcd's answer.
AWAIT_TARGET = (
    "import os as _os, socket as _socket, time as _time\n"
    "_host, _port = _os.environ['TARGET'].split('://')[-1].split(',')[0].rsplit(':', 1)\n"
    "_deadline = _time.monotonic() + 60\n"
    "while True:\n"
    "    try:\n"
    "        _socket.create_connection((_host, int(_port)), timeout=3).close()\n"
    "        break\n"
    "    except OSError:\n"
    "        if _time.monotonic() > _deadline:\n"
    "            break\n"
    "        _time.sleep(0.5)\n"
)

T = TypeVar("T")
Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "elasticjob-operator"
GROUP, VERSION, PLURAL = "elastic.pytorch.org", "v1alpha1", "elasticjobs"
WAIT = 180.0
# The image of every test pod that needs python (and of the jobs' workers): the devcluster
# ignores images, and on kind it is the one image with python the nodes hold.
RUNTIME_IMAGE = os.environ.get("ELASTICJOB_E2E_RUNTIME_IMAGE", "elasticjob-runtime:dev")
HELM_ARGS = tuple(shlex.split(os.environ.get("ELASTICJOB_E2E_HELM_ARGS", "")))
# Pod Security admission at its strictest, for the operator's namespace and the jobs':
# every e2e test proves the chart's and the operator's pods pass it.
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
# What a test's own pod needs in such a namespace; the user id because the images these
# pods name run as root by default.
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# kind (scripts/kind-e2e.sh): one directory of this machine that both workers mount, this
# machine's side and the nodes' side; unset on the devcluster, which shares any claim
SHARED_DIR = os.environ.get("ELASTICJOB_E2E_SHARED_DIR")
SHARED_NODE_DIR = os.environ.get("ELASTICJOB_E2E_SHARED_NODE_DIR")
SHARED_PV_LABEL = "elasticjob.dev/e2e-shared-claim"


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = WAIT, interval: float = 0.5
) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except client.ApiException as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last})")


def shared_claim(c: Cluster, ns: str, name: str) -> None:
    """A ReadWriteMany claim that the pods of every node share and that outlives them. The
    devcluster provisions one for any claim; kind's default class makes host-path volumes,
    each on one node and root's, so there the claim is bound to a volume made here, on the
    directory both workers mount, open to the pods' uid. Those volumes carry
    SHARED_PV_LABEL (= ``ns``) for their module to delete."""
    spec: Obj = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
    if SHARED_DIR and SHARED_NODE_DIR:
        volume = f"{ns}-{name}"
        host = Path(SHARED_DIR) / volume
        host.mkdir(exist_ok=True)
        host.chmod(0o777)
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume, "labels": {SHARED_PV_LABEL: ns}},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": f"{SHARED_NODE_DIR}/{volume}", "type": "Directory"},
                "claimRef": {"namespace": ns, "name": name},
            },
        }
        c.kubectl("apply", "-f", "-", input=json.dumps(pv))
        spec.update(storageClassName="", volumeName=volume)
    c.apply(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": spec,
        },
    )


def delete_shared_volumes(c: Cluster, ns: str) -> None:
    """The volumes :func:`shared_claim` made for ``ns`` (their directories go with kind's)."""
    c.kubectl("delete", "pv", "-l", f"{SHARED_PV_LABEL}={ns}", "--wait=false", check=False)


class Cluster:
    """kubectl/helm as a user runs them, plus API clients for polling."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def run(
        self, tool: str, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [tool, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed:\n{out.stderr}")
        return out

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kw)

    def apply(self, ns: str, obj: Obj, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(obj), check=check)

    def job(self, ns: str, name: str) -> Obj:
        got: Obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        return got

    def status(self, ns: str, name: str) -> Obj:
        return dict(self.job(ns, name).get("status") or {})

    def events(self, ns: str, name: str) -> str:
        """The events about object ``name`` (the job, a pod), as kubectl lists them: what
        a failed assertion on a job's status shows, to say what the operator did."""
        return self.kubectl(
            "-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}"
        ).stdout

    def list_jobs(self, ns: str) -> list[Obj]:
        items: list[Obj] = self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)[
            "items"
        ]
        return items

    def workers(self, ns: str, name: str) -> dict[str, Any]:
        pods = self.core.list_namespaced_pod(
            ns,
            label_selector=f"elastic.pytorch.org/job-name={name},"
            "elastic.pytorch.org/replica-type=worker",
        ).items
        return {p.metadata.name: p for p in pods if p.metadata.deletion_timestamp is None}

    def running_workers(self, ns: str, name: str) -> dict[str, Any]:
        return {n: p for n, p in self.workers(ns, name).items() if p.status.phase == "Running"}


@dataclass(frozen=True)
class Operator:
    """One helm release of the chart, watching one job namespace."""

    cluster: Cluster
    release: str
    namespace: str  # the operator's own
    job_namespace: str  # the one it watches

    @property
    def fullname(self) -> str:
        return f"{self.release}-elasticjob-operator"  # the chart's name for its objects

    def pods(self, running: bool = False) -> list[Any]:
        pods = self.cluster.core.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/name=elasticjob-operator"
        ).items
        return [
            p
            for p in pods
            if not running
            or (p.status.phase == "Running" and p.metadata.deletion_timestamp is None)
        ]


def crd_state(cluster: Cluster, crd: str) -> str:
    """``present``, ``terminating`` (deleted, waiting for its resources) or ``absent``."""
    got = cluster.kubectl(
        "get", "crd", crd, "-o", "jsonpath={.metadata.deletionTimestamp}", check=False
    )
    if got.returncode != 0:
        return "absent"
    return "terminating" if got.stdout.strip() else "present"


@contextmanager
def installed_operator(
    cluster: Cluster, prefix: str, *helm_args: str, suffix: str | None = None
) -> Iterator[Operator]:
    """``helm install`` the chart (progress mirrored every 2 s) into a namespace of its own
    watching another, both enforcing the restricted Pod Security Standard; yield, then
    uninstall it and delete its namespaces (the CRD too if this install added it)."""
    suffix = suffix or uuid.uuid4().hex[:6]
    op = Operator(cluster, f"{prefix}op-{suffix}", f"{prefix}op-{suffix}", f"{prefix}jobs-{suffix}")
    crd = f"{PLURAL}.{GROUP}"
    state = crd_state(cluster, crd)
    had_crd = state == "present"
    if state == "terminating":
        # An earlier module's install deleted it and it still waits for its custom
        # resources to go (slow on a real cluster): helm would find it, skip it, and time
        # out waiting for it to be established.
        wait_for(
            "the CRD an earlier install deleted to be gone",
            lambda: crd_state(cluster, crd) == "absent",
        )
    for ns in (op.namespace, op.job_namespace):
        cluster.core.create_namespace({"metadata": {"name": ns, "labels": RESTRICTED}})
    try:
        cluster.run(
            "helm",
            "install",
            op.release,
            str(CHART),
            "--namespace",
            op.namespace,
            "--create-namespace",
            "--set",
            "resyncSeconds=2",
            "--set",
            f"watchNamespaces={{{op.job_namespace}}}",
            *HELM_ARGS,
            *helm_args,
            "--wait",
            "--timeout=240s",
        )
        wait_for("the operator pod to run", lambda: op.pods(running=True))
        yield op
    finally:
        logs = cluster.kubectl(
            "-n", op.namespace, "logs", f"deploy/{op.fullname}", "--tail=60", check=False
        )
        print("operator log tail:\n" + logs.stdout + logs.stderr)
        cluster.run(
            "helm", "uninstall", op.release, "--namespace", op.namespace, "--wait", check=False
        )
        for ns in (op.job_namespace, op.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        if not had_crd:
            cluster.kubectl("delete", "crd", crd, "--wait=false", check=False)
