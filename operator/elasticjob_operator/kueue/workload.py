"""The Kueue ``Workload`` that stands for a job in its queue. Pure.

One pod set, ``workers``: ``count`` the workers the job wants when it is created,
``minCount`` its ``minReplicas`` (Kueue's partial admission: it may admit any number in
between), the template a worker pod's, so Kueue charges what the pods will request. The
job owns it as its controller, so it goes with the job. Kueue cannot resize an admitted
Workload of a kind it does not know (kubernetes-sigs/kueue#13646, and its workload
slices cover only its own job kinds), so the count is fixed for the Workload's life: a
scale-down gives quota back through ``reclaimablePods``
(:func:`~elasticjob_operator.kueue.admission.reclaim_patch`), and workers it was not
admitted with are asked for by a second Workload (:mod:`~elasticjob_operator.kueue.growth`).
"""

from __future__ import annotations

from typing import Any, Final

from elasticjob_operator import builders, models
from elasticjob_operator.kueue.priority import Priority

Obj = dict[str, Any]

GROUP: Final = "kueue.x-k8s.io"
VERSION: Final = "v1beta2"
API_VERSION: Final = f"{GROUP}/{VERSION}"
QUEUE_LABEL: Final = f"{GROUP}/queue-name"  # Kueue's own label on a job
POD_SET: Final = "workers"


def workload_name(job: str) -> str:
    return f"{job}-workers"


def more_workload_name(job: str) -> str:
    """The second Workload: the workers a partial admission left out (kueue/growth.py)."""
    return f"{job}-more"


def queue_of(labels: dict[str, str] | None) -> str | None:
    """The LocalQueue a job names (Kueue's label), or None: no Kueue for this job."""
    queue = (labels or {}).get(QUEUE_LABEL)
    return queue or None


def workload(
    ref: builders.JobRef,
    spec: models.ElasticJobSpec,
    queue: str,
    incarnation: int,
    priority: Priority | None = None,
    more: int = 0,
) -> Obj:
    """The job's Workload in LocalQueue ``queue``, with the ``priority`` of the class the
    job names (:mod:`~elasticjob_operator.kueue.priority`); ``more``: instead, the second
    one, asking for that many more workers, any of which is worth starting."""
    pod = builders.worker_pod(ref, spec, 0, incarnation)
    template = {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]}
    count, least = (more, 1) if more else (spec.desired_replicas, spec.min_replicas)
    pod_set: Obj = {"name": POD_SET, "count": count, "template": template}
    if least < count:
        pod_set["minCount"] = least
    name = more_workload_name(ref.name) if more else workload_name(ref.name)
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": builders.child_meta(ref, name, {builders.LABEL_JOB: ref.name}),
        "spec": {"queueName": queue, "podSets": [pod_set], **_priority(priority)},
    }


def _priority(priority: Priority | None) -> Obj:
    if priority is None or priority.value is None:
        return {}
    ref = priority.ref
    return {
        "priorityClassRef": {"group": ref.group, "kind": ref.kind, "name": ref.name},
        "priority": priority.value,
    }
