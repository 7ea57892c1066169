"""Which priority class a job's Workload carries, found as Kueue's own job integrations
find it. Pure.

Kueue's label ``kueue.x-k8s.io/priority-class`` on the job names a
``WorkloadPriorityClass`` (a priority for queueing and preemption only); else the worker
template's ``priorityClassName`` names a pod ``PriorityClass``. A Workload that names a
class must also carry its value (Kueue's CEL rule), which the operator reads from the
class when it creates the Workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from elasticjob_operator import models

PRIORITY_LABEL: Final = "kueue.x-k8s.io/priority-class"


@dataclass(frozen=True)
class PriorityRef:
    group: str
    kind: str
    name: str

    @property
    def resource(self) -> str:
        """Where the class lives (cluster-scoped), under /apis/."""
        if self.group == "kueue.x-k8s.io":
            return f"kueue.x-k8s.io/v1beta2/workloadpriorityclasses/{self.name}"
        return f"scheduling.k8s.io/v1/priorityclasses/{self.name}"


@dataclass(frozen=True)
class Priority:
    ref: PriorityRef
    value: int | None  # None: no such class


def priority_ref(labels: dict[str, str] | None, spec: models.ElasticJobSpec) -> PriorityRef | None:
    """The class the job names, Kueue's label first; None: priority 0 (or the cluster's
    default PriorityClass, which Kueue does not apply to a Workload it did not build)."""
    name = (labels or {}).get(PRIORITY_LABEL)
    if name:
        return PriorityRef("kueue.x-k8s.io", "WorkloadPriorityClass", name)
    pod_class = spec.worker.template.spec.model_dump(by_alias=True).get("priorityClassName")
    if pod_class:
        return PriorityRef("scheduling.k8s.io", "PriorityClass", str(pod_class))
    return None
