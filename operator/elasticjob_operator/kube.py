"""The thin I/O layer: observe a job's children, apply a Decision.

Every call goes by URL through :mod:`elasticjob_operator.rest` (plain JSON over the official
client's connection); no decision is taken in this module (see
:mod:`elasticjob_operator.reconcile`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kubernetes.config
from kubernetes.client.exceptions import ApiException

from elasticjob_operator import builders, gang, models, refusals
from elasticjob_operator.decision import ChildRef, Decision, Event, child_key, reported
from elasticjob_operator.kueue import admission as kueue_admission
from elasticjob_operator.kueue import workload as kueue_workload
from elasticjob_operator.kueue.priority import Priority, PriorityRef
from elasticjob_operator.observe import Observed, observe_pod
from elasticjob_operator.rest import Rest, path

log = logging.getLogger(__name__)

Obj = dict[str, Any]


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 merge patch turning ``old`` into ``new`` (removed keys become null)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: Obj = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


def load_config() -> None:
    """In a pod: its service account; elsewhere: the kubeconfig (KUBECONFIG)."""
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]


# where each kind the operator reads, creates or deletes lives: (group/version, resource)
RESOURCES = {
    "Pod": ("v1", "pods"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "ReplicaSet": ("apps/v1", "replicasets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "Workload": (kueue_workload.API_VERSION, "workloads"),
    gang.KIND_KEY: (gang.API_VERSION, gang.RESOURCE),
}


def resource_key(obj: Obj) -> str:
    """An object's key in RESOURCES: its kind, but two kinds are named Workload."""
    return gang.KIND_KEY if obj.get("apiVersion") == gang.API_VERSION else str(obj["kind"])


def _path(kind: str, namespace: str, name: str | None = None) -> str:
    group_version, resource = RESOURCES[kind]
    return path(group_version, namespace, resource, name)


class Conflict(Exception):
    """A child could not be created because its name is taken; retried next round."""


class Refused(Exception):
    """The API server refused a child (403: Pod Security admission, a quota, RBAC) until
    the namespace or the template changes: retried every round, reported as
    ReplicaFailure (refusals.py). It says so in ``event``."""

    def __init__(self, event: Event) -> None:
        super().__init__(event.message)
        self.event = event


class InvalidChild(Exception):
    """The API server refused a child as invalid (400, 422): no retry can help, the spec
    must change, so the job fails with InvalidSpec. The message is one line saying which
    child, from which field, and why (refusals.invalid_message)."""


@dataclass
class Carried:
    """What a round did of its decision's children (their :func:`child_key`), and why it
    stopped short, if it did."""

    created: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    conflict: Conflict | None = None  # a name still taken: the round raises it after its events
    refused: Refused | None = None  # the first child the API server refused


def carry_out(
    decision: Decision,
    delete: Callable[[ChildRef], None],
    create: Callable[[Obj], None],
    stopped: Callable[[Carried], None],
) -> Carried:
    """The deletes, then the creates; a child taken or refused does not stop the others.
    Anything else stops the round, and ``stopped`` is told what was done before it is
    raised: those children are done, and the next round would never say so."""
    done = Carried()
    try:
        for child in decision.delete:
            delete(child)
            done.deleted.add(child.key)
        for obj in decision.create:
            try:
                create(obj)
                done.created.add(child_key(obj))
            except Conflict as exc:
                done.conflict = exc
            except Refused as exc:
                done.refused = done.refused or exc
    except BaseException:
        stopped(done)
        raise
    return done


def uid_selector(uids: Sequence[str]) -> str:
    """The label selector of the children of the jobs ``uids``."""
    if not uids:
        raise ValueError("no job uid to select children by")
    if len(uids) == 1:
        return f"{builders.LABEL_JOB_UID}={uids[0]}"
    return f"{builders.LABEL_JOB_UID} in ({','.join(uids)})"


class Kube:
    def __init__(
        self, network_policies: bool = False, kueue: bool = False, gang: bool = False
    ) -> None:
        self.rest = Rest()
        # list the jobs' NetworkPolicies (only then does the operator need to)
        self.network_policies = network_policies
        # the jobs' Kueue Workloads go with them (only then may the operator touch them)
        self.kueue = kueue
        # the jobs' kube-scheduler Workloads (gang.py): listed, and deleted with them
        self.gang = gang
        self.instance = os.environ.get("HOSTNAME") or socket.gethostname()
        # (job uid, type, reason, message) -> (Event name, count), like kubelet's recorder
        self._events: dict[tuple[str, str, str, str], tuple[str, int]] = {}

    # -- reading ---------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> Obj | None:
        try:
            return self.rest.get(path(models.API_VERSION, namespace, models.PLURAL, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_jobs(self, namespaces: list[str] | None) -> list[Obj]:
        if not namespaces:
            return self.rest.list(f"/apis/{models.API_VERSION}/{models.PLURAL}")
        items: list[Obj] = []
        for ns in namespaces:
            items += self.rest.list(path(models.API_VERSION, ns, models.PLURAL))
        return items

    def observe(
        self,
        ref: builders.JobRef,
        progress: models.Progress | None = None,
        queued: bool = False,
        priority: PriorityRef | None = None,
    ) -> Observed:
        """The job's children; ``queued``: also its Kueue Workload (once admitted, the
        flavors that place its workers; before it exists, the ``priority`` class's value)."""
        ns = ref.namespace
        selector = f"{builders.LABEL_JOB}={ref.name}"
        pods = self.rest.list(
            _path("Pod", ns), f"{selector},{builders.LABEL_ROLE}={builders.ROLE_WORKER}"
        )
        services = self.rest.list(_path("Service", ns), selector)
        deployments = self.rest.list(_path("Deployment", ns), selector)
        budgets = self.rest.list(_path("PodDisruptionBudget", ns), selector)
        policies: list[Obj] = []
        if self.network_policies:
            policies = self.rest.list(_path("NetworkPolicy", ns), selector)

        def ours(o: Obj) -> bool:
            return any(r.get("uid") == ref.uid for r in o["metadata"].get("ownerReferences") or [])

        def owned(objs: list[Obj]) -> frozenset[str]:
            return frozenset(o["metadata"]["name"] for o in objs if ours(o))

        observed = [observe_pod(p, ref.uid) for p in pods]
        gangs: list[Obj] = []
        if self.gang:
            wanted = gang.workload_name(ref.name)
            gangs = [
                w
                for w in self.rest.list(_path(gang.KIND_KEY, ns), selector)
                if ours(w) and w["metadata"]["name"] == wanted
            ]
        admission = more = found = None
        placement = more_placement = kueue_admission.Placement()
        if queued:
            workloads = {
                w["metadata"]["name"]: w
                for w in self.rest.list(_path("Workload", ns), selector)
                if ours(w)
            }
            raw = workloads.get(kueue_workload.workload_name(ref.name))
            if raw is not None:
                admission, placement = self._admission(raw)
            raw = workloads.get(kueue_workload.more_workload_name(ref.name))
            if raw is not None:
                more, more_placement = self._admission(raw)
            if priority is not None and (admission is None or more is None):
                cls = self._cluster_object(priority.resource)
                found = Priority(priority, int(cls["value"]) if cls is not None else None)
        return Observed(
            pods=tuple(p for p in observed if p is not None),
            services=owned(services),
            deployments=owned(deployments),
            network_policies=owned(policies),
            disruption_budgets=owned(budgets),
            progress=progress,
            admission=admission,
            placement=placement,
            more=more,
            more_placement=more_placement,
            priority=found,
            gang_workload=bool(gangs),
            gang_min_count=gang.min_count_of(gangs[0]) if gangs else None,
        )

    def _admission(
        self, workload: Obj
    ) -> tuple[kueue_admission.Admission, kueue_admission.Placement]:
        """What Kueue says of one of the job's Workloads, and where its flavors place pods."""
        admission = kueue_admission.admission_of(workload, kueue_workload.POD_SET)
        flavors = [
            self._cluster_object(f"{kueue_workload.API_VERSION}/resourceflavors/{f}") or {}
            for f in admission.flavors
        ]
        return admission, kueue_admission.placement(flavors)

    def serves(self, api_version: str, resource: str) -> bool:
        """Whether the API server serves ``resource`` in ``api_version`` (its discovery)."""
        try:
            found = self.rest.get(f"/apis/{api_version}")
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == resource for r in found.get("resources") or [])

    def _cluster_object(self, where: str) -> Obj | None:
        """A cluster-scoped object by ``group/version/plural/name`` (a ResourceFlavor, a
        priority class), or None if there is none."""
        try:
            return self.rest.get(f"/apis/{where}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- writing ---------------------------------------------------------------------

    def _create(self, ns: str, obj: Obj) -> None:
        kind = obj["kind"]
        try:
            self.rest.create(_path(resource_key(obj), ns), obj)
        except ApiException as exc:
            name = obj["metadata"]["name"]
            if exc.status == 409:
                raise Conflict(f"{kind} {ns}/{name} already exists") from exc
            if exc.status in refusals.INVALID_CODES:
                raise InvalidChild(
                    refusals.invalid_message(kind, name, exc.body, exc.reason)
                ) from exc
            if exc.status in refusals.REFUSED_CODES:
                message = refusals.api_message(exc.body, str(exc.reason))
                raise Refused(refusals.refusal_event(kind, name, message)) from exc
            raise

    def _delete(self, ns: str, child: ChildRef) -> None:
        query = {}
        if child.kind == "Deployment":
            query = {"propagationPolicy": "Background"}
        elif child.kind == "Pod" and child.force:
            query = {"gracePeriodSeconds": "0"}
        try:
            self.rest.delete(_path(child.kind, ns, child.name), **query)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete_children(self, namespace: str, uids: Sequence[str]) -> None:
        """Delete deleted jobs' children now, selected by their uid label (one call per
        kind for all of ``uids``): the garbage collector would too, but at
        kube-controller-manager's 20 requests a second (50 jobs' children took over a
        minute). Children from before the label existed are left to it, and so are the
        jobs' Secrets (the operator may not delete Secrets)."""
        selector = uid_selector(uids)
        # the etcd Deployment, then its ReplicaSet, so that neither makes a new etcd pod
        # once the pods are gone
        for kind in ("Deployment", "ReplicaSet"):
            self.rest.delete(
                _path(kind, namespace), labelSelector=selector, propagationPolicy="Background"
            )
        self.rest.delete(_path("Pod", namespace), labelSelector=selector)
        if self.network_policies:
            self.rest.delete(_path("NetworkPolicy", namespace), labelSelector=selector)
        self.rest.delete(_path("PodDisruptionBudget", namespace), labelSelector=selector)
        if self.kueue:  # the quota goes back now, not when the garbage collector gets here
            self.rest.delete(_path("Workload", namespace), labelSelector=selector)
        if self.gang:
            self.rest.delete(_path(gang.KIND_KEY, namespace), labelSelector=selector)
        for service in self.rest.list(_path("Service", namespace), selector):
            self._delete(namespace, ChildRef("Service", service["metadata"]["name"]))

    def post_event(self, ref: builders.JobRef, event: Event) -> None:
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        message = event.message[:1024]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
            "involvedObject": {
                "apiVersion": models.API_VERSION,
                "kind": models.KIND,
                "name": ref.name,
                "namespace": ref.namespace,
                "uid": ref.uid,
            },
            "reason": event.reason,
            "message": message,
            "type": event.type,
            "source": {"component": builders.MANAGER},
            "reportingComponent": builders.MANAGER,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        key = (ref.uid, event.type, event.reason, message)
        try:
            seen = self._events.get(key)
            if seen is not None:  # the same decision again (a crash loop): count it
                name, count = seen
                try:
                    self.rest.patch(
                        path("v1", ref.namespace, "events", name),
                        {"count": count + 1, "lastTimestamp": now},
                    )
                    self._events[key] = (name, count + 1)
                    return
                except ApiException as exc:
                    if exc.status != 404:
                        raise
            created = self.rest.create(path("v1", ref.namespace, "events"), body)
            if len(self._events) > 4096:
                self._events.clear()
            self._events[key] = (str(created["metadata"]["name"]), 1)
        except ApiException as exc:  # an event lost is not worth failing the round
            log.warning("could not post event %s for %s: %s", event.reason, ref.name, exc.reason)

    def _still_there(self, ref: builders.JobRef) -> bool:
        job = self.get_job(ref.namespace, ref.name)
        if job is None:
            return False
        meta = job["metadata"]
        return bool(meta.get("uid") == ref.uid and not meta.get("deletionTimestamp"))

    def apply(self, ref: builders.JobRef, job: Obj, decision: Decision) -> Event | None:
        """Children first, then events, then the decided status: a status is written only
        for a world that exists, so a crash in between is repaired by the next round's
        observation. The one exception comes before the children: what they embody
        (``decision.status_first``, the placement), which the next round could not tell
        from them. A child the API server refuses ends the round with nothing more
        written; its refusal event is returned for the caller to decide on (refusals.py)."""
        ns = ref.namespace
        if (decision.create or decision.delete) and not self._still_there(ref):
            return None  # deleted while we decided: the garbage collector owns the children now
        self._send_status(ref, decision.status_first)

        def say_what_was_done(done: Carried) -> None:  # the round stops before its events
            for event in reported(decision.events, done.created, done.deleted):
                self.post_event(ref, event)

        done = carry_out(
            decision,
            lambda child: self._delete(ns, child),
            lambda obj: self._create(ns, obj),
            say_what_was_done,
        )
        if done.refused is not None:
            say_what_was_done(done)
            return done.refused.event
        for event in decision.events:
            self.post_event(ref, event)
        if done.conflict is not None:
            raise done.conflict
        for name, patch in decision.workload_status.items():
            self._patch_workload_status(ref, name, patch)
        self._patch_status(ref, job, decision.status)
        if decision.delete_job:
            try:
                self.rest.delete(
                    path(models.API_VERSION, ns, models.PLURAL, ref.name),
                    propagationPolicy="Background",
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
        return None

    def _patch_workload_status(self, ref: builders.JobRef, name: str, patch: Obj) -> None:
        """One of the job's Workloads' status (quota given back): a patch computed from
        the resourceVersion it may carry; if Kueue wrote since (409), the next round
        computes it again."""
        try:
            self.rest.patch(_path("Workload", ref.namespace, name) + "/status", patch)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            log.info(
                "%s/%s: Workload %s changed meanwhile (%s)",
                ref.namespace,
                ref.name,
                name,
                exc.status,
            )

    def _patch_status(
        self, ref: builders.JobRef, job: Obj, status: models.ElasticJobStatus
    ) -> None:
        old = job.get("status") or {}
        new = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        self._send_status(ref, merge_patch(old, new))

    def _send_status(self, ref: builders.JobRef, patch: Obj) -> None:
        """A merge patch of the job's status; nothing to send, nothing sent."""
        if not patch:
            return
        try:
            self.rest.patch(
                path(models.API_VERSION, ref.namespace, models.PLURAL, ref.name) + "/status",
                {"status": patch},
            )
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to record
                raise
