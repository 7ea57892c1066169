"""The ElasticJob API as pydantic models: the single source of truth.

The CRD's OpenAPI schema (with the descriptions `kubectl explain` prints and the
CEL rules the API server enforces) is generated from these classes by
:mod:`elasticjob_operator.crd`. Field names are the archived TorchElastic
controller's (``rdzvEndpoint``, ``minReplicas``, ``replicaSpecs.Worker`` ...), so
its users' manifests apply unchanged; everything we add is optional.

Each cross-field rule is written once in :data:`SPEC_RULES`: its CEL expression
goes into the CRD and its Python predicate runs when the operator parses a job,
so a job that reached the operator some other way is judged by the same rules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

from elasticjob_runtime import contract

GROUP: Final = "elastic.pytorch.org"
VERSION: Final = "v1alpha1"
KIND: Final = "ElasticJob"
PLURAL: Final = "elasticjobs"
SINGULAR: Final = "elasticjob"
SHORT_NAMES: Final = ("ej",)
API_VERSION: Final = f"{GROUP}/{VERSION}"

# etcd 3.6 (the release devcluster/go/go.mod pins): the store only needs the v3 API.
DEFAULT_ETCD_IMAGE: Final = "quay.io/coreos/etcd:v3.6.16"
DEFAULT_BACKOFF_LIMIT: Final = 6
DEFAULT_MAX_RESTARTS: Final = 3
C10D_PORT: Final = 29400

# A worker pod's /dev/shm when the spec does not say (see ElasticJobSpec.shm_size).
DEFAULT_SHM_SIZE: Final = "2Gi"
SHM_PATH: Final = "/dev/shm"

# spec.hangTimeoutSeconds: below 10 s a slow step or a checkpoint save at a step boundary
# would pass for a hang; above a day it would never fire before a person looks anyway.
MIN_HANG_TIMEOUT_SECONDS: Final = 10
MAX_HANG_TIMEOUT_SECONDS: Final = 86400

# Longest job name whose pods `<name>-worker-<i>` (i < 10000) keep a 63-char hostname.
MAX_NAME_LENGTH: Final = 63 - len("-worker-") - 4
# Most workers a job may ask for: indexes 0..9999, which the name limit above assumes
# (a 5-digit index on a longest name is a 64-char hostname, refused on every create).
MAX_REPLICAS: Final = 10000


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown keys are an error."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        use_enum_values=False,
    )


class _Open(_Model):
    """A partially modelled Kubernetes object: unknown keys are kept as they are."""

    model_config = ConfigDict(extra="allow")


class RestartPolicy(StrEnum):
    ALWAYS = "Always"
    ON_FAILURE = "OnFailure"
    NEVER = "Never"
    EXIT_CODE = "ExitCode"


class CleanPodPolicy(StrEnum):
    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class RdzvBackend(StrEnum):
    ETCD_V3 = "etcd-v3"
    C10D = "c10d"
    ETCD = "etcd"


assert tuple(b.value for b in RdzvBackend) == contract.RDZV_BACKENDS
assert RdzvBackend.ETCD_V3.value == contract.DEFAULT_RDZV_BACKEND


# Parts of the pod template the operator reads or extends are typed (a wrong type is
# refused by the API server, naming the field, instead of breaking every round of the
# operator); their items, and every other field, pass to the pods unchanged.
_Objects = list[dict[str, Any]]


class EnvVar(_Open):
    """A core/v1 EnvVar; the operator reads its name (a variable the template sets is kept)."""

    name: str = Field(min_length=1, description="Variable name.")


class Container(_Open):
    """A core/v1 Container. Only `name` and `image` are checked here, and the types of
    the fields the operator extends; every other Container field is accepted and passed
    to the pod unchanged."""

    name: str = Field(min_length=1, description="Container name, unique within the pod.")
    image: str = Field(
        min_length=1,
        description="Container image. The first container is the trainer: its exit code "
        "decides what restartPolicy ExitCode does.",
    )
    command: list[str] | None = Field(default=None, description="Entrypoint array.")
    env: list[EnvVar] | None = Field(
        default=None, description="Environment; the operator adds the contract's variables."
    )
    ports: _Objects | None = Field(
        default=None, description="Ports; the operator may add the health probes' port."
    )
    volume_mounts: _Objects | None = Field(
        default=None, description="Volume mounts; the operator may add /dev/shm."
    )


class PodSpec(_Open):
    """A core/v1 PodSpec. Only `containers` is checked here, and the types of the fields
    the operator extends; every other PodSpec field is accepted and copied to the worker
    pods (restartPolicy, hostname and subdomain are set by the operator)."""

    containers: list[Container] = Field(
        min_length=1, description="The worker's containers; the first one runs the training."
    )
    init_containers: list[Container] | None = Field(
        default=None, description="Init containers; they get /dev/shm too."
    )
    volumes: _Objects | None = Field(
        default=None, description="Volumes; the operator may add /dev/shm."
    )
    tolerations: _Objects | None = Field(
        default=None, description="Tolerations; the operator adds short node-lost ones."
    )
    host_ipc: bool | None = Field(
        default=None, alias="hostIPC", description="Use the host's IPC namespace (and /dev/shm)."
    )


class TemplateMetadata(_Open):
    """Metadata of the worker pods."""

    labels: dict[str, str] | None = Field(default=None, description="Copied to every pod.")
    annotations: dict[str, str] | None = Field(default=None, description="Copied to every pod.")


class PodTemplate(_Open):
    """A core/v1 PodTemplateSpec for every worker pod."""

    metadata: TemplateMetadata | None = Field(
        default=None, description="Labels and annotations copied to every worker pod."
    )
    spec: PodSpec = Field(description="The worker pod's spec (core/v1 PodSpec).")


class ReplicaSpec(_Model):
    """How to run the workers."""

    replicas: int | None = Field(
        default=None,
        ge=0,
        le=MAX_REPLICAS,
        description="Desired number of worker pods, between minReplicas and maxReplicas. "
        "Changed by `kubectl scale` and HPA through the scale subresource. "
        "Absent means minReplicas.",
    )
    restart_policy: RestartPolicy = Field(
        default=RestartPolicy.ON_FAILURE,
        description="What happens when a worker pod fails or disappears. OnFailure: it is "
        "replaced, and each replacement counts against backoffLimit. Always: it is replaced "
        "and backoffLimit does not apply. Never: it is not replaced; the job carries on with "
        "fewer workers while at least minReplicas are active. ExitCode: the trainer's exit "
        "code decides; 1-127 is a permanent error that fails the job, 128 and above (killed "
        "by a signal, e.g. OOM 137, SIGTERM 143) or a lost pod is retried like OnFailure. "
        "Worker pods themselves always get restartPolicy Never: the operator does the "
        "replacing, so it can count.",
    )
    template: PodTemplate = Field(
        description="The worker pod template (core/v1 PodTemplateSpec). The operator adds "
        "the rendezvous environment (PET_RDZV_ID, PET_RDZV_BACKEND, PET_RDZV_ENDPOINT, "
        "PET_NNODES, PET_NPROC_PER_NODE, PET_MAX_RESTARTS, PET_RDZV_CONF) and pod identity "
        "(ELASTICJOB_*) to every container; a variable the template already sets is kept."
    )


class ReplicaSpecs(_Model):
    """Replica types; elastic training has one, Worker."""

    worker: ReplicaSpec = Field(alias="Worker", description="The training workers.")


class EtcdSpec(_Model):
    """The etcd the operator provisions for the job when rdzvEndpoint is absent."""

    image: str = Field(
        default=DEFAULT_ETCD_IMAGE,
        min_length=1,
        description="etcd image (3.6: the rendezvous uses only the v3 API).",
    )
    resources: dict[str, Any] | None = Field(
        default=None,
        description="core/v1 ResourceRequirements of the etcd container; unset: requests of "
        "100m CPU and 128Mi memory, so that busy workers on its node cannot starve it.",
    )


class RdzvTLS(_Model):
    """The client certificate for a user's etcd (spec.rdzvEndpoint) that serves TLS."""

    secret_name: str = Field(
        min_length=1,
        max_length=253,
        description="A Secret in the job's namespace with ca.crt (the CA that signed etcd's "
        "certificate), tls.crt and tls.key (a client certificate etcd accepts), as "
        "`kubectl create secret generic NAME --from-file=ca.crt --from-file=tls.crt "
        "--from-file=tls.key` makes it. Mounted into every worker container; the operator "
        "reads it too, for the job's progress.",
    )


class ElasticJobSpec(_Model):
    """Desired state of an elastic PyTorch training job."""

    rdzv_endpoint: str | None = Field(
        default=None,
        max_length=1024,
        description="host:port of the rendezvous store. Absent: with rdzvBackend etcd-v3 the "
        "operator provisions an etcd for the job (Deployment and Service <name>-etcd); with "
        "c10d it is worker 0 (<name>-worker-0.<name>-worker.<namespace>.svc:29400).",
    )
    rdzv_backend: RdzvBackend = Field(
        default=RdzvBackend.ETCD_V3,
        description="Rendezvous backend: etcd-v3 (etcd's v3 API, works with etcd 3.4+), "
        "c10d (torch's TCPStore on worker 0), or etcd (torch's legacy backend, needs an "
        "etcd serving the v2 API at rdzvEndpoint).",
    )
    rdzv_tls: RdzvTLS | None = Field(
        default=None,
        alias="rdzvTLS",
        description="Mutual TLS to a user's etcd at rdzvEndpoint: the Secret holding the CA "
        "and the workers' client certificate. Not needed (nor allowed) for the etcd the "
        "operator provisions, which always speaks mutual TLS with certificates of its own.",
    )
    rdzv_conf: dict[str, Annotated[str, StringConstraints(max_length=1024)]] | None = Field(
        default=None,
        max_length=64,
        description="Extra rendezvous settings, passed as PET_RDZV_CONF key=value pairs "
        "(torchrun --rdzv-conf), e.g. {join_timeout: '900'}.",
    )
    min_replicas: int = Field(
        default=1, ge=1, le=MAX_REPLICAS, description="Fewest workers the training runs with."
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="Most workers the training runs with. Absent: "
        "the larger of minReplicas and replicaSpecs.Worker.replicas.",
    )
    nproc_per_node: int | str = Field(
        default=1,
        description="Trainer processes per worker pod (PET_NPROC_PER_NODE): a number, or "
        "auto, cpu or gpu as torchrun accepts.",
    )
    max_restarts: int = Field(
        default=DEFAULT_MAX_RESTARTS,
        ge=0,
        description="Restarts of the worker group inside a pod before its agent gives up "
        "(PET_MAX_RESTARTS). A pod whose agent gave up fails and is handled by restartPolicy.",
    )
    replica_specs: ReplicaSpecs = Field(description="The workers: count, restart policy, pod.")
    clean_pod_policy: CleanPodPolicy = Field(
        default=CleanPodPolicy.RUNNING,
        description="Which worker pods are deleted when the job finishes: All, Running (the "
        "ones still pending or running) or None. With All or Running the provisioned etcd is "
        "deleted too.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the job (and so all its children) this many seconds after it "
        "succeeded or failed. Absent: keep it.",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Fail the job (reason DeadlineExceeded) and stop its workers when it has "
        "run this long since it started (or was last resumed).",
    )
    backoff_limit: int = Field(
        default=DEFAULT_BACKOFF_LIMIT,
        ge=0,
        description="How many worker replacements are allowed before the job fails "
        "(reason BackoffLimitExceeded). Not applied with restartPolicy Always.",
    )
    suspend: bool = Field(
        default=False,
        description="true deletes the worker pods and keeps the job; false again starts a "
        "new run (a new PET_RDZV_ID) that resumes from the latest checkpoint.",
    )
    pod_disruption_budget: bool = Field(
        default=False,
        description="true: a PodDisruptionBudget over the workers with minAvailable = "
        "minReplicas, so evictions (kubectl drain, a cluster autoscaler) never take the job "
        "below its minimum; an eviction it allows replaces the worker uncounted.",
    )
    etcd: EtcdSpec | None = Field(
        default=None,
        description="Settings of the etcd the operator provisions (only when rdzvEndpoint is "
        "absent).",
    )
    shm_size: str = Field(
        default=DEFAULT_SHM_SIZE,
        max_length=64,
        description="Size limit of the memory-backed /dev/shm (emptyDir medium Memory) every "
        "worker container gets; a container runtime's own /dev/shm is 64 MiB. It holds the "
        "node-memory checkpoint copy (restarts reload from RAM, not the disk; the newest "
        "copy is written before the previous one is removed, so it needs about twice the "
        "checkpoint's size) and PyTorch DataLoader workers' shared-memory batches. "
        "The default 2Gi holds two checkpoints of about 1 GB: some 80M parameters with "
        "fp32 Adam state. tmpfs pages count against the pod's memory limit only once "
        "written. A Kubernetes quantity (512Mi, 8Gi); 0 adds no volume. A template that "
        "mounts its own /dev/shm (or sets hostIPC) is left as it is. A save that does not "
        "fit is reported once as a Warning event (CheckpointNotInNodeMemory).",
    )
    hang_timeout_seconds: int | None = Field(
        default=None,
        ge=MIN_HANG_TIMEOUT_SECONDS,
        le=MAX_HANG_TIMEOUT_SECONDS,
        description="Restart a worker group whose workers complete no training step "
        "(CheckpointManager.mark_step, which the training-loop API calls) for this many "
        "seconds, counted from the first step after each rendezvous, so rendezvous, restore "
        "and the first step's warm-up never count. The worker pods' agents restart their "
        "workers (ELASTICJOB_HANG_TIMEOUT), which costs one of maxRestarts; each hang is a "
        f"Warning event (HangDetected) and counted in status.hangs. {MIN_HANG_TIMEOUT_SECONDS}"
        f" to {MAX_HANG_TIMEOUT_SECONDS}; make it several times the longest gap between two "
        "steps (evaluation, synchronous checkpoint saves). Absent: off.",
    )
    scheduling_policy: dict[str, Any] | None = Field(
        default=None,
        description="Accepted for compatibility with the archived controller's run policy; "
        "not used.",
    )

    @model_validator(mode="after")
    def _rules(self) -> ElasticJobSpec:
        for rule in SPEC_RULES:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    # -- effective values (what absent fields mean) ------------------------------------

    @property
    def worker(self) -> ReplicaSpec:
        return self.replica_specs.worker

    @property
    def desired_replicas(self) -> int:
        """replicaSpecs.Worker.replicas, or minReplicas when absent."""
        r = self.worker.replicas
        return self.min_replicas if r is None else r

    def capped(self, workers: int) -> ElasticJobSpec:
        """This spec wanting at most ``workers`` (what a queue admitted)."""
        if workers >= self.desired_replicas:
            return self
        worker = self.worker.model_copy(update={"replicas": workers})
        specs = self.replica_specs.model_copy(update={"worker": worker})
        return self.model_copy(update={"replica_specs": specs})

    @property
    def effective_max_replicas(self) -> int:
        if self.max_replicas is not None:
            return self.max_replicas
        return max(self.min_replicas, self.worker.replicas or 0)

    @property
    def shm_size_bytes(self) -> int:
        """spec.shmSize in bytes; 0 means: add no /dev/shm volume."""
        return quantity_bytes(self.shm_size)

    @property
    def provisions_etcd(self) -> bool:
        """The operator runs an etcd for this job: no endpoint given and an etcd backend."""
        return self.rdzv_endpoint is None and self.rdzv_backend is RdzvBackend.ETCD_V3


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: CEL for the API server, the same rule in Python for us."""

    cel: str
    message: str
    field_path: str
    check: Callable[[ElasticJobSpec], bool]


def _nproc_ok(s: ElasticJobSpec) -> bool:
    v = s.nproc_per_node
    return v >= 1 if isinstance(v, int) else v in ("auto", "cpu", "gpu")


# A non-negative Kubernetes quantity of bytes, as sizeLimit takes it (no milli, no exponent).
QUANTITY_PATTERN: Final = r"^[0-9]+([.][0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_QUANTITY_UNITS: Final[dict[str, int]] = {
    "": 1,
    **{s: 1000**i for i, s in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
    **{s: 1024**i for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
}


def quantity_bytes(quantity: str) -> int:
    """Bytes in a quantity matching QUANTITY_PATTERN (rounded up, as Kubernetes does)."""
    match = re.fullmatch(QUANTITY_PATTERN, quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a quantity of bytes such as 512Mi or 2Gi")
    number = quantity[: len(quantity) - len(match.group(2) or "")]
    return math.ceil(Decimal(number) * _QUANTITY_UNITS[match.group(2) or ""])


_HOST_PORT = r"(https?://)?[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5}"
ENDPOINT_PATTERN: Final = rf"^{_HOST_PORT}(,{_HOST_PORT})*$"

SPEC_RULES: Final[tuple[Rule, ...]] = (
    Rule(
        cel=f"!has(self.rdzvEndpoint) || self.rdzvEndpoint.matches('{ENDPOINT_PATTERN}')",
        message="spec.rdzvEndpoint must be host:port (or a comma-separated list of them): "
        "e.g. etcd-service:2379",
        field_path=".rdzvEndpoint",
        check=lambda s: (
            s.rdzv_endpoint is None or re.fullmatch(ENDPOINT_PATTERN, s.rdzv_endpoint) is not None
        ),
    ),
    Rule(
        cel="!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
        message="spec.minReplicas must not exceed spec.maxReplicas: "
        "lower minReplicas or raise maxReplicas",
        field_path=".minReplicas",
        check=lambda s: s.max_replicas is None or s.min_replicas <= s.max_replicas,
    ),
    Rule(
        cel="!has(self.replicaSpecs.Worker.replicas) || "
        "self.replicaSpecs.Worker.replicas >= self.minReplicas",
        message="spec.replicaSpecs.Worker.replicas must be at least spec.minReplicas: "
        "raise replicas or lower minReplicas",
        field_path=".replicaSpecs.Worker.replicas",
        check=lambda s: s.worker.replicas is None or s.worker.replicas >= s.min_replicas,
    ),
    Rule(
        cel="!has(self.replicaSpecs.Worker.replicas) || !has(self.maxReplicas) || "
        "self.replicaSpecs.Worker.replicas <= self.maxReplicas",
        message="spec.replicaSpecs.Worker.replicas must not exceed spec.maxReplicas: "
        "lower replicas or raise maxReplicas",
        field_path=".replicaSpecs.Worker.replicas",
        check=lambda s: (
            s.worker.replicas is None
            or s.max_replicas is None
            or s.worker.replicas <= s.max_replicas
        ),
    ),
    Rule(
        cel="self.rdzvBackend != 'etcd' || has(self.rdzvEndpoint)",
        message="spec.rdzvBackend etcd needs etcd's v2 API, which the provisioned etcd 3.6 "
        "does not serve: use rdzvBackend etcd-v3, or set spec.rdzvEndpoint to an etcd "
        "serving the v2 API",
        field_path=".rdzvBackend",
        check=lambda s: s.rdzv_backend is not RdzvBackend.ETCD or s.rdzv_endpoint is not None,
    ),
    Rule(
        cel="!has(self.etcd) || (!has(self.rdzvEndpoint) && self.rdzvBackend == 'etcd-v3')",
        message="spec.etcd configures the etcd the operator provisions, which happens only "
        "with rdzvBackend etcd-v3 and no spec.rdzvEndpoint: remove spec.etcd or "
        "spec.rdzvEndpoint",
        field_path=".etcd",
        check=lambda s: s.etcd is None or s.provisions_etcd,
    ),
    Rule(
        cel="!has(self.rdzvTLS) || (has(self.rdzvEndpoint) && self.rdzvBackend != 'c10d' && "
        "!self.rdzvEndpoint.contains('http://'))",
        message="spec.rdzvTLS is for a user's etcd that serves TLS: it needs spec.rdzvEndpoint "
        "(without http://) and an etcd rdzvBackend (etcd-v3 or etcd); the etcd the operator "
        "provisions has TLS of its own, so remove spec.rdzvTLS",
        field_path=".rdzvTLS",
        check=lambda s: (
            s.rdzv_tls is None
            or (
                s.rdzv_endpoint is not None
                and s.rdzv_backend is not RdzvBackend.C10D
                and "http://" not in s.rdzv_endpoint
            )
        ),
    ),
    Rule(
        cel="type(self.nprocPerNode) == int ? self.nprocPerNode >= 1 : "
        "self.nprocPerNode in ['auto', 'cpu', 'gpu']",
        message="spec.nprocPerNode must be a number of at least 1, or auto, cpu or gpu: "
        "e.g. nprocPerNode: 2",
        field_path=".nprocPerNode",
        check=_nproc_ok,
    ),
    Rule(
        cel="!has(self.rdzvConf) || self.rdzvConf.all(k, k.matches('^[A-Za-z_][A-Za-z0-9_]*$')"
        " && !self.rdzvConf[k].contains(',') && !self.rdzvConf[k].contains('='))",
        message="spec.rdzvConf keys must be identifiers and values must not contain ',' or "
        "'=': they are joined as key=value,key=value into PET_RDZV_CONF",
        field_path=".rdzvConf",
        check=lambda s: all(
            k.isidentifier() and "," not in v and "=" not in v
            for k, v in (s.rdzv_conf or {}).items()
        ),
    ),
    Rule(
        cel=f"self.shmSize.matches('{QUANTITY_PATTERN}')",
        message="spec.shmSize must be a quantity of bytes: e.g. 512Mi, 2Gi or 8Gi "
        "(0: no /dev/shm volume)",
        field_path=".shmSize",
        check=lambda s: re.fullmatch(QUANTITY_PATTERN, s.shm_size) is not None,
    ),
)

# Rules on the whole object (CEL `self` is the ElasticJob; only metadata.name is visible).
NAME_RULES: Final[tuple[tuple[str, str], ...]] = (
    (
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters: worker pods are named "
        "<name>-worker-<index> and their hostname is limited to 63",
    ),
    (
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "metadata.name must be a DNS label (lowercase letters, digits and '-', starting with "
        "a letter): it names the job's Services",
    ),
)


# -- status ---------------------------------------------------------------------------


class ConditionType(StrEnum):
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SCALING = "Scaling"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    # Kueue (rule "Queue"): waiting for admission in the job's queue, and admitted
    QUEUED = "Queued"
    ADMITTED = "Admitted"
    # the API server refused a child (e.g. Pod Security admission); no effect on phase
    REPLICA_FAILURE = "ReplicaFailure"


class Condition(_Model):
    """One condition; `kubectl wait --for=condition=<type>` reads these."""

    type: ConditionType = Field(description="Condition type.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="Machine-readable CamelCase reason.")
    message: str = Field(default="", description="What happened, for people.")
    last_transition_time: datetime | None = Field(
        default=None, description="When status last changed."
    )


class ReplicaStatus(_Model):
    """Counts of worker pods."""

    active: int = Field(default=0, description="Worker pods pending or running.")
    succeeded: int = Field(default=0, description="Worker pods that exited 0.")
    failed: int = Field(
        default=0, description="Worker failures seen so far (failed or lost pods, cumulative)."
    )


class ReplicaStatuses(_Model):
    worker: ReplicaStatus = Field(
        default_factory=ReplicaStatus, alias="Worker", description="The workers."
    )


class Progress(_Open):
    """Training progress as the runtime publishes it in the job's rendezvous etcd."""

    step: int | None = Field(default=None, description="Optimizer steps done.")
    epoch: int | None = Field(default=None, description="Current epoch.")
    world_size: int | None = Field(default=None, description="Trainer processes in the run.")
    samples_per_second: float | None = Field(
        default=None, description="Recent throughput, samples per second over all workers."
    )
    checkpoint_step: int | None = Field(default=None, description="Step of the newest checkpoint.")
    checkpoint_error: str | None = Field(
        default=None,
        description="Why the newest checkpoint could not be saved (a full or read-only "
        "directory); absent once a save works again.",
    )
    trainer_restarts: int | None = Field(
        default=None, description="Restarts of the worker group inside the pods (torchrun's)."
    )
    update_time: datetime | None = Field(default=None, description="When the runtime published it.")


class LastRecovery(_Model):
    """The newest recovery that ended."""

    cause: str = Field(description="Why the training paused (docs/goodput.md).")
    pause_seconds: float = Field(description="From its last step to the next, less one step.")
    step: int = Field(description="The first step committed after it.")
    time: datetime = Field(description="When that step was committed.")


class TimelineMark(_Model):
    """A point of the job's timeline: a run's start, a recovery, or a suspension."""

    cause: str = Field(description="start, suspended, or a recovery's cause (docs/goodput.md).")
    since: datetime = Field(description="When training stopped (for a start: the run's start).")
    time: datetime = Field(description="The first step after it.")
    pause_seconds: float = Field(description="The time it cost (a recovery: less one step).")
    from_step: int = Field(description="The step committed before it.")
    step: int = Field(description="The first step committed after it.")
    world: int = Field(description="The group's size after it (0: not known).")


class GoodputTotals(_Open):
    """Where the job's wall time went, in seconds: every second in exactly one bucket."""

    runs: int = Field(default=1, description="The runs counted (a resumed job starts a new one).")
    wall_seconds: float = Field(
        description="From the job's creation to the ledger's last entry (throughTime)."
    )
    training_seconds: float = Field(description="Committed steps.")
    waiting_seconds: float = Field(
        description="Before a run's first agent started: queued by Kueue, waiting for pods "
        "to be scheduled, images pulled, and the time a job was suspended."
    )
    startup_seconds: float = Field(
        description="From a run's first agent's start to its first step."
    )
    paused_seconds: dict[str, float] = Field(
        default_factory=dict, description="Recoveries' pauses, by cause."
    )
    lost_seconds: float = Field(
        description="Work done and thrown away: steps in flight a fault dropped, steps done "
        "again after going back to a checkpoint."
    )
    checkpoint_seconds: float = Field(description="Saves the training waited for.")
    recoveries: dict[str, int] = Field(default_factory=dict, description="Recoveries by cause.")
    longest_pause_seconds: float = Field(
        description="The longest recovery, from its last step to the next, less one step."
    )
    step: int = Field(default=0, description="The highest step committed.")
    through_time: datetime = Field(description="The ledger's last entry.")
    timeline: list[TimelineMark] = Field(
        default_factory=list,
        description="Each run's start, each suspension and the newest recoveries, oldest "
        "first (a bounded list): `kubectl elasticjob-timeline` draws it.",
    )


class Goodput(GoodputTotals):
    """The job's goodput, from the runtime's ledger of each run (docs/goodput.md)."""

    run_id: str = Field(description="The run (PET_RDZV_ID) whose ledger was read last.")
    ratio: float = Field(description="Training time over wall time (0-1).")
    percent: str = Field(description="The ratio as a percentage, for `kubectl get -o wide`.")
    last_recovery: LastRecovery | None = Field(
        default=None, description="The newest recovery that ended, and what it cost."
    )
    earlier: GoodputTotals | None = Field(
        default=None,
        description="The runs before this one, up to their last ledger entry (the time "
        "from there to this run's first agent counts as waiting).",
    )


class NodeMemoryFallback(_Model):
    """A worker's node-memory checkpoint copy failed (reported once per run, as an event)."""

    run_id: str = Field(description="The run (PET_RDZV_ID) it happened in.")
    pod: str = Field(description="The worker pod that reported it first.")
    step: int = Field(description="The checkpoint step whose memory copy failed.")
    checkpoint_bytes: int = Field(description="Size of that checkpoint.")
    shm_bytes: int | None = Field(
        default=None, description="Size of the filesystem holding the copy (/dev/shm)."
    )
    message: str = Field(description="What the Warning event said.")
    time: datetime | None = Field(default=None, description="When the operator reported it.")


class Hangs(_Model):
    """Hangs the workers' agents detected and restarted the group for (HangDetected)."""

    count: int = Field(default=0, description="Hangs detected so far, over all runs.")
    run_id: str | None = Field(
        default=None, description="The run (PET_RDZV_ID) the last hang was in."
    )
    last_round: int | None = Field(
        default=None, description="The rendezvous round of the last hang said (per run)."
    )
    message: str = Field(default="", description="What the last HangDetected event said.")
    time: datetime | None = Field(default=None, description="When the operator reported it.")


class Divergences(_Model):
    """Steps at which the workers found that their ranks held different training state
    (the runtime's fingerprint check): the job failed (Diverged), or with the runtime's
    on_divergence=resync, rank 0's state was copied to every rank (Resynced)."""

    count: int = Field(default=0, description="Divergences reported so far, over all runs.")
    run_id: str | None = Field(
        default=None, description="The run (PET_RDZV_ID) the last divergence was in."
    )
    last_step: int | None = Field(
        default=None, description="The training step of the last divergence said (per run)."
    )
    message: str = Field(default="", description="What the last event said.")
    time: datetime | None = Field(default=None, description="When the operator reported it.")


class StuckWorker(_Model):
    """A worker pod the kubelet could not start, or kept restarting, as the operator
    warned about it (a WorkerStuck event): one per pod and reason."""

    pod: str = Field(description="The worker pod.")
    container: str = Field(default="", description="Its container that waits.")
    reason: str = Field(
        description="The kubelet's waiting reason: CreateContainerConfigError, "
        "CreateContainerError, ImagePullBackOff, ErrImageNeverPull, InvalidImageName, "
        "ImageInspectError or CrashLoopBackOff."
    )
    message: str = Field(default="", description="The kubelet's message when it was warned.")
    time: datetime | None = Field(default=None, description="When the operator warned.")


class WorkerIndexes(_Model):
    """The operator's memory about worker indexes, so that a missing pod can be told apart
    from one never created (a lost worker is counted and replaced per restartPolicy)."""

    launched: list[int] = Field(
        default_factory=list, description="Indexes whose pod was created in this run."
    )
    replacing: list[int] = Field(
        default_factory=list,
        description="Indexes whose failed pod was deleted to be replaced (already counted).",
    )
    retired: list[int] = Field(
        default_factory=list,
        description="Indexes that left the job and are not replaced (restartPolicy Never, "
        "or a failure after training finished).",
    )
    disrupted: list[int] = Field(
        default_factory=list,
        description="Indexes whose pod the cluster took (preempted, evicted): replaced "
        "without being counted against backoffLimit.",
    )


class ElasticJobStatus(_Model):
    """Observed state of the job, written by the operator."""

    phase: str | None = Field(
        default=None,
        description="Summary of the conditions: Created, Running, Restarting, Scaling, "
        "Queued, Suspended, Succeeded or Failed.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Created, Running, Restarting, Scaling, Succeeded, Failed, Suspended, "
        "Queued and Admitted (a job in a Kueue queue), ReplicaFailure (the API server "
        "refused to create a child; the message says why).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    replica_statuses: ReplicaStatuses = Field(
        default_factory=ReplicaStatuses, description="Worker pod counts."
    )
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (for the scale subresource)."
    )
    start_time: datetime | None = Field(
        default=None, description="When the current run started (reset on resume)."
    )
    completion_time: datetime | None = Field(
        default=None, description="When the job succeeded or failed."
    )
    restart_count: int = Field(default=0, description="Worker pods replaced so far.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation the operator last acted on."
    )
    desired_replicas: int | None = Field(
        default=None, description="Worker count the operator last acted on (to notice scaling)."
    )
    admitted_replicas: int | None = Field(
        default=None,
        description="Workers Kueue admitted and the job may run (a job in a Kueue queue only).",
    )
    placement: str | None = Field(
        default=None,
        description="What places the workers, decided in the job's first round: Kueue "
        "(admitted by its queue), Gang (kube-scheduler binds at least minReplicas together "
        "or none, through the Workload <job>-gang), both joined by '+', or OneByOne.",
    )
    incarnation: int = Field(
        default=0,
        description="Run number: 0 for the first run, +1 per resume. PET_RDZV_ID is the job "
        "uid, suffixed -<incarnation> when above 0.",
    )
    below_min_since: datetime | None = Field(
        default=None, description="Since when fewer than minReplicas workers are active."
    )
    worker_indexes: WorkerIndexes = Field(
        default_factory=WorkerIndexes, description="Operator bookkeeping of worker indexes."
    )
    progress: Progress | None = Field(
        default=None, description="Training progress mirrored from the runtime."
    )
    goodput: Goodput | None = Field(
        default=None,
        description="Where the job's time went (training, start-up, pauses by cause, lost "
        "work, checkpoints), from the runtime's ledger of its current run.",
    )
    node_memory_fallback: NodeMemoryFallback | None = Field(
        default=None,
        description="Set once a worker's node-memory checkpoint copy did not fit (restarts "
        "then read the checkpoint directory): raise spec.shmSize.",
    )

    hangs: Hangs | None = Field(
        default=None,
        description="Set once the workers' agents detected a hang (spec.hangTimeoutSeconds).",
    )
    divergences: Divergences | None = Field(
        default=None,
        description="Set once the workers found their ranks training different models.",
    )
    stuck_workers: list[StuckWorker] | None = Field(
        default=None,
        description="Worker pods the kubelet cannot start (a missing Secret, an image it "
        "cannot pull, a crash loop), each warned once per reason (WorkerStuck) and kept "
        "while that pod exists; the Running condition's message says which wait now.",
    )

    def condition(self, type_: ConditionType) -> Condition | None:
        for c in self.conditions:
            if c.type is type_:
                return c
        return None

    def is_true(self, type_: ConditionType) -> bool:
        c = self.condition(type_)
        return c is not None and c.status == "True"

    @property
    def finished(self) -> bool:
        return self.is_true(ConditionType.SUCCEEDED) or self.is_true(ConditionType.FAILED)


class ElasticJob(_Model):
    """An elastic PyTorch training job: worker pods that rendezvous through etcd, are
    replaced when they fail, and can be scaled between minReplicas and maxReplicas."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["elastic.pytorch.org/v1alpha1"] = Field(
        default="elastic.pytorch.org/v1alpha1", description="elastic.pytorch.org/v1alpha1"
    )
    kind: Literal["ElasticJob"] = Field(default="ElasticJob", description="ElasticJob")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard metadata.")
    spec: ElasticJobSpec = Field(description="Desired state.")
    status: ElasticJobStatus = Field(
        default_factory=ElasticJobStatus, description="Observed state, set by the operator."
    )


def run_id(uid: str, incarnation: int) -> str:
    """PET_RDZV_ID: the job uid, so a re-created job never meets an old round; suffixed
    with the incarnation so a resumed run starts a fresh rendezvous too."""
    return uid if incarnation == 0 else f"{uid}-{incarnation}"
