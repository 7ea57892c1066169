"""ElasticJob manifests for the e2e tests: a good one, an archived-controller one, and
malformed ones the API server must refuse with a message naming the field."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

Obj = dict[str, Any]
# The devcluster records images without pulling them (pods run from this repo's
# environment); on another cluster set this to the Dockerfile's `runtime` image.
RUNTIME_IMAGE = os.environ.get("ELASTICJOB_E2E_RUNTIME_IMAGE", "elasticjob-runtime:dev")
# The archived example's image and pull policy, unless a runtime image is given.
ARCHIVED_CONTAINER: Obj = (
    {"image": RUNTIME_IMAGE, "imagePullPolicy": "IfNotPresent"}
    if "ELASTICJOB_E2E_RUNTIME_IMAGE" in os.environ
    else {"image": "torchelastic/examples:0.2.0", "imagePullPolicy": "Always"}
)


def job(name: str, command: list[str], replicas: int = 2, **spec: Any) -> Obj:
    """A job whose workers run `command` (the node agent runs it as a local process)."""
    return {
        "apiVersion": "elastic.pytorch.org/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 4,
            "replicaSpecs": {
                "Worker": {
                    "replicas": replicas,
                    "restartPolicy": "OnFailure",
                    "template": {
                        "metadata": {"labels": {"app": name}},
                        "spec": {
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": RUNTIME_IMAGE,
                                    "command": command,
                                }
                            ]
                        },
                    },
                }
            },
            **spec,
        },
    }


def archived(name: str, endpoint: str, command: list[str]) -> Obj:
    """The archived TorchElastic controller's example, field for field (plus our command)."""
    return {
        "apiVersion": "elastic.pytorch.org/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name},
        "spec": {
            "rdzvEndpoint": endpoint,
            "minReplicas": 1,
            "maxReplicas": 2,
            "replicaSpecs": {
                "Worker": {
                    "replicas": 2,
                    "restartPolicy": "ExitCode",
                    "template": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "spec": {
                            "containers": [
                                {
                                    "name": "elasticjob-worker",
                                    **ARCHIVED_CONTAINER,
                                    "command": command,
                                }
                            ]
                        },
                    },
                }
            },
        },
    }


def archived_args_only(name: str, endpoint: str, args: list[str]) -> Obj:
    """The archived example as it was written: the container gives only `args`, which the
    image's ENTRYPOINT runs; here the runtime image's, elasticjob-run."""
    obj = archived(name, endpoint, [])
    [container] = obj["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    del container["command"]
    container.update(
        {
            "image": RUNTIME_IMAGE,
            "imagePullPolicy": "IfNotPresent",
            "args": args,
            "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints"}],
        }
    )
    obj["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["volumes"] = [
        {"name": "checkpoints", "emptyDir": {}}
    ]
    return obj


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    keys = path.split(".")

    def edit(obj: Obj) -> None:
        node = obj
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value

    return edit


_DELETE = object()
W = "spec.replicaSpecs.Worker"
C0 = f"{W}.template.spec.containers.0"

# (id, edit, text the API server's refusal must contain)
MALFORMED: list[tuple[str, Callable[[Obj], None], str]] = [
    (
        "min-above-max",
        _set("spec.minReplicas", 5),
        "spec.minReplicas must not exceed spec.maxReplicas",
    ),
    (
        "replicas-above-max",
        _set(f"{W}.replicas", 9),
        "spec.replicaSpecs.Worker.replicas must not exceed",
    ),
    (
        "replicas-below-min",
        _set("spec.minReplicas", 3),
        "spec.replicaSpecs.Worker.replicas must be at least",
    ),
    ("min-zero", _set("spec.minReplicas", 0), "spec.minReplicas"),
    ("min-not-a-number", _set("spec.minReplicas", "two"), "spec.minReplicas"),
    (
        "bad-restart-policy",
        _set(f"{W}.restartPolicy", "Sometimes"),
        "spec.replicaSpecs.Worker.restartPolicy",
    ),
    ("bad-clean-pod-policy", _set("spec.cleanPodPolicy", "Some"), "spec.cleanPodPolicy"),
    ("bad-backend", _set("spec.rdzvBackend", "zookeeper"), "spec.rdzvBackend"),
    ("endpoint-without-port", _set("spec.rdzvEndpoint", "etcd-service"), "spec.rdzvEndpoint"),
    (
        "etcd-v2-backend-without-endpoint",
        _set("spec.rdzvBackend", "etcd"),
        "spec.rdzvBackend etcd needs",
    ),
    (
        "rdzv-tls-for-the-provisioned-etcd",
        _set("spec.rdzvTLS", {"secretName": "etcd-client"}),
        "spec.rdzvTLS is for a user's etcd that serves TLS",
    ),
    ("no-replica-specs", _set("spec.replicaSpecs", _DELETE), "spec.replicaSpecs"),
    ("no-worker", _set("spec.replicaSpecs.Worker", _DELETE), "spec.replicaSpecs.Worker"),
    ("no-template", _set(f"{W}.template", _DELETE), "spec.replicaSpecs.Worker.template"),
    (
        "no-containers",
        _set(f"{W}.template.spec.containers", []),
        "spec.replicaSpecs.Worker.template.spec.containers",
    ),
    (
        "container-without-image",
        _set(f"{C0}.image", _DELETE),
        "spec.replicaSpecs.Worker.template.spec.containers[0].image",
    ),
    ("nproc-zero", _set("spec.nprocPerNode", 0), "spec.nprocPerNode must be"),
    ("nproc-word", _set("spec.nprocPerNode", "many"), "spec.nprocPerNode must be"),
    ("negative-backoff", _set("spec.backoffLimit", -1), "spec.backoffLimit"),
    ("zero-deadline", _set("spec.activeDeadlineSeconds", 0), "spec.activeDeadlineSeconds"),
    ("negative-ttl", _set("spec.ttlSecondsAfterFinished", -5), "spec.ttlSecondsAfterFinished"),
    ("suspend-not-bool", _set("spec.suspend", "yes"), "spec.suspend"),
    ("rdzv-conf-comma", _set("spec.rdzvConf", {"timeout": "1,2"}), "spec.rdzvConf"),
    ("shm-size-not-a-quantity", _set("spec.shmSize", "2GB"), "spec.shmSize must be a quantity"),
    ("typo-field", _set("spec.minReplica", 1), "spec.minReplica"),
    ("name-too-long", _set("metadata.name", "a" * 52), "metadata.name must be at most"),
    ("name-with-dot", _set("metadata.name", "a.b"), "metadata.name must be a DNS label"),
    (
        "hang-timeout-too-short",
        _set("spec.hangTimeoutSeconds", 5),
        "spec.hangTimeoutSeconds in body should be greater than or equal to 10",
    ),
    ("too-many-workers", _set("spec.maxReplicas", 10001), "spec.maxReplicas"),
    # what test_hostile_input.py found: a template part the operator extends, mistyped
    ("env-not-a-list", _set(f"{C0}.env", -2), "template.spec.containers[0].env"),
    ("env-without-name", _set(f"{C0}.env", [{"value": "1"}]), "env[0].name"),
    ("labels-not-strings", _set(f"{W}.template.metadata", {"labels": {"a": 1}}), "labels"),
]


def malformed(base: Obj, edit: Callable[[Obj], None]) -> Obj:
    obj = copy.deepcopy(base)
    edit(obj)
    return obj


# A test worker's first line: exit on SIGTERM. In a container the script is PID 1, which
# has no default action for SIGTERM (a real kubelet then waits the whole grace period:
# long enough for a job below minReplicas to fail); on the devcluster it is not PID 1.
# It exits 143, as SIGTERM's default action would be reported: a worker that exits 0 has
# finished training, and the operator would call a job whose pod was deleted a success.
EXIT_ON_SIGTERM = "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"

# Worker 0 publishes a progress record (step 1234) to the job's etcd, as the runtime's
# ProgressReporter would, then every worker sleeps.
PUBLISH_PROGRESS_AND_SLEEP = [
    "python",
    "-c",
    EXIT_ON_SIGTERM + "import os, time\n"
    "from elasticjob_runtime import contract\n"
    "from elasticjob_runtime.etcd import records\n"
    "from elasticjob_runtime.etcd.tls import connect\n"
    "if os.environ['ELASTICJOB_POD_NAME'].endswith('-0'):\n"
    "    e = connect(os.environ['PET_RDZV_ENDPOINT'])  # TLS as the variables say\n"
    "    record = records.Progress(step=1234, world_size=2, samples_per_second=99.5,\n"
    "                              restart_count=0, updated=time.time())\n"
    "    key = contract.progress_key(os.environ['PET_RDZV_ID'])\n"
    "    while True:\n"
    "        try:\n"
    "            e.put(key, records.encode_progress(record)); break\n"
    "        except Exception as exc:\n"
    "            print('etcd not ready:', exc, flush=True); time.sleep(0.5)\n"
    "    print('published', flush=True)\n"
    "time.sleep(3600)\n",
]
