"""Pure builders of a job's NetworkPolicies: who may open connections to its pods.

Two ingress-only policies per job, owned by it (the garbage collector removes them with
it):

* ``<job>-worker``: the job's worker pods accept connections only from the job's own
  worker pods, on every port. gloo and NCCL's TCP bootstrap listen on ephemeral ports
  chosen at run time, c10d's store on 29400, the runtime's health server on 8090, so a
  port list would either break training or be every port anyway.
* ``<job>-etcd`` (only when the operator provisions the etcd): the etcd accepts
  connections on its client port only from the job's worker pods (the rendezvous) and from
  the operator's pods (it reads training progress there).

Probes need no rule: NetworkPolicy always admits traffic from the pod's own node, which is
where the kubelet probes from. Nothing scrapes worker or etcd pods (the operator's metrics
live on the operator's pod). Egress stays open: workers read datasets and write
checkpoints wherever the user keeps them (object stores, file servers) and resolve names
through the cluster DNS; the operator cannot know those destinations, and a policy that
guessed would break training rather than protect it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from elasticjob_operator import builders
from elasticjob_runtime import contract

Obj = dict[str, Any]

NAMESPACE_NAME_LABEL: Final = "kubernetes.io/metadata.name"
# What the operator's Deployment (the chart) tells it about itself.
ENV_ENABLED: Final = "ELASTICJOB_NETWORK_POLICY"
ENV_NAMESPACE: Final = "ELASTICJOB_OPERATOR_NAMESPACE"
ENV_LABELS: Final = "ELASTICJOB_OPERATOR_LABELS"


@dataclass(frozen=True)
class OperatorPeer:
    """The operator's pods, as a NetworkPolicy peer: its namespace and selector labels."""

    namespace: str
    labels: tuple[tuple[str, str], ...]

    def peer(self) -> Obj:
        return {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}},
            "podSelector": {"matchLabels": dict(self.labels)},
        }


def parse_labels(raw: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` as the chart writes the operator's selector labels."""
    pairs = []
    for item in (part.strip() for part in raw.split(",")):
        key, sep, value = item.partition("=")
        if not item:
            continue
        if not sep or not key:
            raise ValueError(f"{ENV_LABELS}: {item!r} is not key=value; write k=v,k2=v2")
        pairs.append((key.strip(), value.strip()))
    return tuple(sorted(pairs))


def peer_from_env(env: Mapping[str, str]) -> OperatorPeer | None:
    """The operator's identity if policies are on (the default), None if they are off.

    Raises ValueError with one line saying what to set when they are on but the operator
    does not know where it runs (the chart always sets both variables)."""
    enabled = env.get(ENV_ENABLED, "true").strip().lower()
    if enabled in ("false", "0", "no", "off"):
        return None
    if enabled not in ("true", "1", "yes", "on"):
        raise ValueError(f"{ENV_ENABLED}={enabled!r}: set it to true or false")
    namespace = env.get(ENV_NAMESPACE, "").strip()
    labels = parse_labels(env.get(ENV_LABELS, ""))
    if not namespace or not labels:
        raise ValueError(
            f"{ENV_ENABLED} is on, so the operator must know its pods: set {ENV_NAMESPACE} "
            f"to its namespace and {ENV_LABELS} to its pods' labels (k=v,...), "
            f"or set {ENV_ENABLED}=false"
        )
    return OperatorPeer(namespace, labels)


def worker_policy_name(job: str) -> str:
    return f"{job}-worker"


def etcd_policy_name(job: str) -> str:
    return f"{job}-etcd"


def _policy(ref: builders.JobRef, name: str, selects: dict[str, str], rule: Obj) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": builders.child_meta(ref, name, selects),
        "spec": {
            "podSelector": {"matchLabels": selects},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def _workers_of(job: str) -> Obj:
    return {"podSelector": {"matchLabels": builders.worker_selector(job)}}


def worker_policy(ref: builders.JobRef) -> Obj:
    """The job's workers accept connections only from each other, on any port."""
    selects = builders.worker_selector(ref.name)
    return _policy(ref, worker_policy_name(ref.name), selects, {"from": [_workers_of(ref.name)]})


def etcd_policy(ref: builders.JobRef, operator: OperatorPeer) -> Obj:
    """The job's etcd accepts client connections only from its workers and the operator."""
    rule = {
        "from": [_workers_of(ref.name), operator.peer()],
        "ports": [{"protocol": "TCP", "port": contract.DEFAULT_ETCD_PORT}],
    }
    return _policy(ref, etcd_policy_name(ref.name), builders.etcd_selector(ref.name), rule)


def policies(ref: builders.JobRef, operator: OperatorPeer, own_etcd: bool) -> list[Obj]:
    """Every policy the job should have: the workers', and the etcd's if we run one for
    the job alone (the shared etcd's policy is the chart's)."""
    out = [worker_policy(ref)]
    if own_etcd:
        out.append(etcd_policy(ref, operator))
    return out
