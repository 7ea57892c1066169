"""The names the operator injects into worker pods and the runtime reads.

Defined once here, torch-free, so the operator imports the same constants the
launcher uses. The ``PET_*`` names are torchrun's own, so a plain ``torchrun``
in a pod works with what the operator injects.
"""

from typing import Final

# torchrun's variables (torch.distributed.run reads PET_<OPTION>).
RDZV_ID: Final = "PET_RDZV_ID"
RDZV_BACKEND: Final = "PET_RDZV_BACKEND"
RDZV_ENDPOINT: Final = "PET_RDZV_ENDPOINT"
RDZV_CONF: Final = "PET_RDZV_CONF"
NNODES: Final = "PET_NNODES"
NPROC_PER_NODE: Final = "PET_NPROC_PER_NODE"
MAX_RESTARTS: Final = "PET_MAX_RESTARTS"

# Ours alone.
CHECKPOINT_DIR: Final = "ELASTICJOB_CHECKPOINT_DIR"
# root of the node-memory checkpoint copy (default /dev/shm; "off" disables it)
CHECKPOINT_MEMORY_DIR: Final = "ELASTICJOB_CHECKPOINT_MEMORY_DIR"
JOB_NAME: Final = "ELASTICJOB_JOB_NAME"
JOB_NAMESPACE: Final = "ELASTICJOB_NAMESPACE"
# the ElasticJob's metadata.uid: with the namespace and run id, the job's identity
# (checkpoints/job_identity.py)
JOB_UID: Final = "ELASTICJOB_JOB_UID"
POD_NAME: Final = "ELASTICJOB_POD_NAME"
POD_IP: Final = "ELASTICJOB_POD_IP"
NODE_NAME: Final = "ELASTICJOB_NODE_NAME"
HEALTH_PORT: Final = "ELASTICJOB_HEALTH_PORT"
PROGRESS: Final = "ELASTICJOB_PROGRESS"  # "1" (default) publishes progress to etcd
# the etcd that progress goes to; elasticjob-run sets it to the etcd it rendezvouses on
PROGRESS_ENDPOINT: Final = "ELASTICJOB_PROGRESS_ENDPOINT"
# TLS to the rendezvous etcd (elasticjob_runtime.etcd.tls): PEM files of the CA that
# signed etcd's certificate, and of this client's certificate and key. The operator sets
# them for its own etcd and for spec.rdzvTLS; torch's rdzv_conf keys cacert, cert, key
# (and protocol=https) say the same and win over them.
ETCD_CACERT: Final = "ELASTICJOB_ETCD_CACERT"
ETCD_CERT: Final = "ELASTICJOB_ETCD_CERT"
ETCD_KEY: Final = "ELASTICJOB_ETCD_KEY"
# elasticjob-run: "0" turns warm spare workers off; extra modules for spares to import
WARM_SPARES: Final = "ELASTICJOB_WARM_SPARES"
# elasticjob-run: how many warm spares a node keeps (unset: one per local rank; 0: none)
WARM_SPARE_COUNT: Final = "ELASTICJOB_WARM_SPARE_COUNT"
# elasticjob-run: "0" starts each spare as an interpreter of its own, not a fork of a warm one
WARM_SPARE_FORK: Final = "ELASTICJOB_WARM_SPARE_FORK"
WARM_IMPORT: Final = "ELASTICJOB_WARM_IMPORT"
# elasticjob-run's directory of round assignments shared with its workers (channel.py)
AGENT_CHANNEL: Final = "ELASTICJOB_AGENT_CHANNEL"
# "0": the training-loop API (elasticjob_runtime.Run) restarts instead of regrouping in place
IN_PLACE: Final = "ELASTICJOB_IN_PLACE"
# the most MiB a new worker grows its heap by while it waits for its first group's other
# members (training/waiting_heap.py); "0" turns that off
WAIT_HEAP_MB: Final = "ELASTICJOB_WAIT_HEAP_MB"
# elasticjob-run: seconds without a training step before the agent restarts its workers
# (unset or 0: off); the operator sets it from spec.hangTimeoutSeconds
HANG_TIMEOUT: Final = "ELASTICJOB_HANG_TIMEOUT"
# how many nodes the job asked for (the operator sets the job's replicas): the etcd-v3
# rendezvous's first round waits for that many, up to its last call, before it starts
# with fewer (rendezvous/membership.py awaited)
DESIRED_NODES: Final = "ELASTICJOB_DESIRED_NODES"
# set in a worker that a warm spare became: when it got its round (unix seconds)
WORKER_ASSIGNED_AT: Final = "ELASTICJOB_WORKER_ASSIGNED_AT"
# set per worker and round by elasticjob-run's etcd-v3 rendezvous: "<run id>/<round>", the
# round every node of the group shares; Run.round_id adds the token rank 0 draws for it
ROUND_ID: Final = "ELASTICJOB_ROUND_ID"
# Why the worker's current round was opened (rendezvous.membership.RoundCause: crash,
# node-lost, join, departure, hang, start), per round like ROUND_ID; absent when not known.
ROUND_CAUSE: Final = "ELASTICJOB_ROUND_CAUSE"
# set by elasticjob-run for its workers: when the agent started (unix time), where the
# goodput ledger of a new run starts counting (goodput/keeper.py)
AGENT_STARTED: Final = "ELASTICJOB_AGENT_STARTED"

DEFAULT_RDZV_BACKEND: Final = "etcd-v3"
RDZV_BACKENDS: Final = ("etcd-v3", "c10d", "etcd")
# the rendezvous backends whose endpoint is an etcd (torch's own etcd backends included)
ETCD_RDZV_BACKENDS: Final = ("etcd-v3", "etcd", "etcd-v2")
DEFAULT_ETCD_PORT: Final = 2379
DEFAULT_HEALTH_PORT: Final = 8090
# Flags of every etcd we start (the job's, the bench's, the tests'): etcd grants no lease
# shorter than ceil(1.5 x election timeout), 2 s with its default 1000 ms; with 600 ms it
# is ceil(0.9 s) = 1 s, the runtime's default lease_ttl. etcd wants the election timeout
# at least 5 heartbeats; a single-member etcd has no peers, so nothing else changes.
ETCD_FAST_LEASE_FLAGS: Final = ("--heartbeat-interval=100", "--election-timeout=600")


def progress_key(run_id: str) -> str:
    """etcd key under which a run's progress is published (read by the operator)."""
    return f"/elasticjob/{run_id}/progress"


def ledger_key(run_id: str) -> str:
    """etcd key where rank 0 keeps the run's goodput ledger for a group that restarts: on
    a lease of its own that outlives the progress record's (goodput/keeper.py)."""
    return f"/elasticjob/{run_id}/ledger"


def memory_fallback_key(run_id: str, pod: str) -> str:
    """etcd key where a pod reports that its node-memory checkpoint copy failed (read by
    the operator, which says so once in the job's events)."""
    return f"{memory_fallback_prefix(run_id)}{pod}"


def hang_key(run_id: str, round_number: int) -> str:
    """etcd key where the agents record that the run hung in round ``round_number`` (one
    key per round however many agents noticed; read by the operator)."""
    return f"{hang_prefix(run_id)}{round_number:010d}"


def hang_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}hangs/"


def divergence_key(run_id: str, step: int) -> str:
    """etcd key where a worker records that the ranks disagreed at ``step`` (read by the
    operator, which fails the job, or says so in an event when the workers resynced)."""
    return f"{divergence_prefix(run_id)}{step:012d}"


def divergence_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}divergence/"


def memory_fallback_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}memory-fallback/"


def run_prefix(run_id: str) -> str:
    """etcd key prefix holding all of one run's rendezvous state."""
    return f"/elasticjob/{run_id}/"


def rdzv_prefix(run_id: str) -> str:
    """What a running node watches: the round key, the member keys and the leaving keys."""
    return f"{run_prefix(run_id)}rdzv/"


def members_prefix(run_id: str) -> str:
    """Under it, a key per live agent on the agent's own lease, holding its address
    (:class:`~elasticjob_runtime.etcd.records.Member`): the operator finds a pod's node
    by it."""
    return f"{rdzv_prefix(run_id)}members/"


def leaving_prefix(run_id: str) -> str:
    """Under it, a key per node leaving the run, on that node's member lease: put by the
    node itself when told to stop (a SIGTERM), or by the operator for every node a
    scale-down removes, in one transaction, so the others regroup once without them."""
    return f"{rdzv_prefix(run_id)}leaving/"
