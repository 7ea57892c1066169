"""Gang placement by kube-scheduler: which jobs have it, and the Workload it needs. Pure.

Kubernetes 1.35 serves a Workload API (``scheduling.k8s.io/v1alpha1``, feature gate
``GenericWorkload``), and kube-scheduler's ``GangScheduling`` plugin binds the pods whose
``spec.workloadRef`` names a gang pod group only once ``minCount`` of them have a node, all
together; until then it binds none of them. With ``minCount`` = ``minReplicas`` a job never
holds part of a cluster while it waits for the rest. Workers beyond the minimum, and the
replacement of a lost one, are placed one by one: the group's count includes the pods
already bound.

A pod group's policy is immutable, so a changed ``minReplicas`` replaces the Workload
(pods name it, not its uid). A pod's ``workloadRef`` is immutable too, and a gang whose
other members lack one never reaches its count, so a job's placement is decided once, in
its first round, and kept in ``status.placement`` (:func:`placement_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from elasticjob_operator import builders, models

Obj = dict[str, Any]

GROUP: Final = "scheduling.k8s.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
RESOURCE: Final = "workloads"
# the Kube client's name for it: Kueue's Workload already has the kind's name
KIND_KEY: Final = "GangWorkload"
POD_GROUP: Final = "workers"
ENV: Final = "ELASTICJOB_GANG_SCHEDULING"

# the words of status.placement, joined by "+"
KUEUE: Final = "Kueue"
GANG: Final = "Gang"
ONE_BY_ONE: Final = "OneByOne"


class Mode(StrEnum):
    """The chart's ``gangScheduling.enabled``."""

    AUTO = "auto"  # where the API server serves the Workload API
    ON = "true"  # required: the operator stops at start where it is not served
    OFF = "false"


def mode_from_env(env: Mapping[str, str]) -> Mode:
    raw = env.get(ENV, "auto").strip().lower() or "auto"
    try:
        return Mode(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: set it to auto, true or false") from None


def enabled(mode: Mode, served: bool) -> bool:
    """Whether new jobs get gang placement; ValueError, saying what to change, when the
    chart requires it and the API server does not serve the API."""
    if mode is Mode.ON and not served:
        raise ValueError(
            f"gangScheduling.enabled is true ({ENV}), but the API server does not serve "
            f"{API_VERSION} {RESOURCE}: start kube-apiserver with --feature-gates="
            f"GenericWorkload=true --runtime-config={API_VERSION}=true and kube-scheduler "
            "with --feature-gates=GenericWorkload=true,GangScheduling=true, or set "
            "gangScheduling.enabled to auto or false"
        )
    return mode is not Mode.OFF and served


def placement_of(recorded: str | None, queued: bool, gang: bool, has_pods: bool) -> str:
    """status.placement: what it already says, else what places this job's workers. A job
    that has pods but no record predates it (or the gang): its pods have no workloadRef,
    so it stays without the gang."""
    if recorded:
        return recorded
    words = [KUEUE] if queued else []
    if gang and not has_pods:
        words.append(GANG)
    return "+".join(words) or ONE_BY_ONE


def in_use(placement: str | None, gang_on: bool) -> bool:
    """Whether the job's workers are placed as a gang: its record says so, and the operator
    gangs (Config.gang: the API is served and the chart allows it)."""
    return gang_on and GANG in (placement or "").split("+")


def workload_name(job: str) -> str:
    return f"{job}-gang"


def workload_ref(job: str) -> Obj:
    """A worker pod's ``spec.workloadRef``."""
    return {"name": workload_name(job), "podGroup": POD_GROUP}


def workload(ref: builders.JobRef, min_count: int) -> Obj:
    """The job's Workload: one gang pod group of ``min_count``, the job its controller."""
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": builders.child_meta(
            ref, workload_name(ref.name), {builders.LABEL_JOB: ref.name}
        ),
        "spec": {
            "controllerRef": {
                "apiGroup": models.GROUP,
                "kind": models.KIND,
                "name": ref.name,
            },
            "podGroups": [{"name": POD_GROUP, "policy": {"gang": {"minCount": min_count}}}],
        },
    }


def min_count_of(workload: Obj) -> int | None:
    """The gang's minCount in a Workload as read back; None if it has no such group."""
    for group in (workload.get("spec") or {}).get("podGroups") or []:
        if group.get("name") == POD_GROUP:
            gang = (group.get("policy") or {}).get("gang") or {}
            count = gang.get("minCount")
            return int(count) if count is not None else None
    return None


@dataclass(frozen=True)
class GangPlan:
    replace: bool  # the Workload there has another minCount: delete it first
    create: bool


def decide(min_replicas: int, existing: int | None, present: bool) -> GangPlan:
    """What to do about the job's Workload: ``existing`` its minCount if ``present``."""
    if not present:
        return GangPlan(replace=False, create=True)
    if existing != min_replicas:
        return GangPlan(replace=True, create=True)
    return GangPlan(replace=False, create=False)
