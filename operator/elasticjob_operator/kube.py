"""The thin I/O layer: observe a job's children, apply a Decision.

Everything here is a direct call of the official ``kubernetes`` client; no decision is
taken in this module (see :mod:`elasticjob_operator.reconcile`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any, cast

import kubernetes
from kubernetes.client.exceptions import ApiException

from elasticjob_operator import builders, models, refusals
from elasticjob_operator.decision import ChildRef, Decision, Event
from elasticjob_operator.observe import Observed, observe_pod

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


class Kube:
    def __init__(self, network_policies: bool = False) -> None:
        self.api = kubernetes.client.ApiClient()
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.apps = kubernetes.client.AppsV1Api(self.api)
        self.networking = kubernetes.client.NetworkingV1Api(self.api)
        # list the jobs' NetworkPolicies (only then does the operator need to)
        self.network_policies = network_policies
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.instance = os.environ.get("HOSTNAME") or socket.gethostname()
        # (job uid, type, reason, message) -> (Event name, count), like kubelet's recorder
        self._events: dict[tuple[str, str, str, str], tuple[str, int]] = {}

    # -- reading ---------------------------------------------------------------------

    @staticmethod
    def _json(resp: Any) -> Any:
        return json.loads(resp.data)

    def get_job(self, namespace: str, name: str) -> Obj | None:
        try:
            return dict(
                self._json(
                    self.custom.get_namespaced_custom_object(
                        models.GROUP,
                        models.VERSION,
                        namespace,
                        models.PLURAL,
                        name,
                        _preload_content=False,
                    )
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_jobs(self, namespaces: list[str] | None) -> list[Obj]:
        if not namespaces:
            resp = self.custom.list_cluster_custom_object(
                models.GROUP, models.VERSION, models.PLURAL, _preload_content=False
            )
            return list(self._json(resp)["items"])
        items: list[Obj] = []
        for ns in namespaces:
            resp = self.custom.list_namespaced_custom_object(
                models.GROUP, models.VERSION, ns, models.PLURAL, _preload_content=False
            )
            items += self._json(resp)["items"]
        return items

    def observe(self, ref: builders.JobRef, progress: models.Progress | None = None) -> Observed:
        ns = ref.namespace
        selector = f"{builders.LABEL_JOB}={ref.name}"
        pods = self._json(
            self.core.list_namespaced_pod(
                ns,
                label_selector=f"{selector},{builders.LABEL_ROLE}={builders.ROLE_WORKER}",
                _preload_content=False,
            )
        )["items"]
        services = self._json(
            self.core.list_namespaced_service(ns, label_selector=selector, _preload_content=False)
        )["items"]
        deployments = self._json(
            self.apps.list_namespaced_deployment(
                ns, label_selector=selector, _preload_content=False
            )
        )["items"]

        policies: list[Obj] = []
        if self.network_policies:
            policies = self._json(
                self.networking.list_namespaced_network_policy(
                    ns, label_selector=selector, _preload_content=False
                )
            )["items"]

        def owned(objs: list[Obj]) -> frozenset[str]:
            return frozenset(
                o["metadata"]["name"]
                for o in objs
                if any(r.get("uid") == ref.uid for r in o["metadata"].get("ownerReferences") or [])
            )

        observed = [observe_pod(p, ref.uid) for p in pods]
        return Observed(
            pods=tuple(p for p in observed if p is not None),
            services=owned(services),
            deployments=owned(deployments),
            network_policies=owned(policies),
            progress=progress,
        )

    # -- writing ---------------------------------------------------------------------

    def _create(self, ns: str, obj: Obj) -> None:
        kind = obj["kind"]
        body = cast(Any, obj)  # the client serialises plain dicts as they are
        try:
            if kind == "Pod":
                self.core.create_namespaced_pod(ns, body)
            elif kind == "Service":
                self.core.create_namespaced_service(ns, body)
            elif kind == "Deployment":
                self.apps.create_namespaced_deployment(ns, body)
            elif kind == "NetworkPolicy":
                self.networking.create_namespaced_network_policy(ns, body)
            else:  # pragma: no cover - builders make only these kinds
                raise ValueError(f"cannot create {kind}")
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
        try:
            if child.kind == "Pod" and child.force:
                self.core.delete_namespaced_pod(child.name, ns, grace_period_seconds=0)
            elif child.kind == "Pod":
                self.core.delete_namespaced_pod(child.name, ns)
            elif child.kind == "Service":
                self.core.delete_namespaced_service(child.name, ns)
            else:
                self.apps.delete_namespaced_deployment(
                    child.name, ns, propagation_policy="Background"
                )
        except ApiException as exc:
            if exc.status != 404:
                raise

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
                    self.core.patch_namespaced_event(
                        name, ref.namespace, {"count": count + 1, "lastTimestamp": now}
                    )
                    self._events[key] = (name, count + 1)
                    return
                except ApiException as exc:
                    if exc.status != 404:
                        raise
            created = self.core.create_namespaced_event(ref.namespace, cast(Any, body))
            if len(self._events) > 4096:
                self._events.clear()
            self._events[key] = (str(created.metadata.name), 1)
        except ApiException as exc:  # an event lost is not worth failing the round
            log.warning("could not post event %s for %s: %s", event.reason, ref.name, exc.reason)

    def _still_there(self, ref: builders.JobRef) -> bool:
        job = self.get_job(ref.namespace, ref.name)
        if job is None:
            return False
        meta = job["metadata"]
        return bool(meta.get("uid") == ref.uid and not meta.get("deletionTimestamp"))

    def apply(self, ref: builders.JobRef, job: Obj, decision: Decision) -> None:
        """Children first, then events, then status: a status is written only for a world
        that exists, so a crash in between is repaired by the next round's observation.
        A child the API server refuses ends the round with that said instead (refusals.py)."""
        ns = ref.namespace
        if (decision.create or decision.delete) and not self._still_there(ref):
            return  # deleted while we decided: the garbage collector owns the children now
        for child in decision.delete:
            self._delete(ns, child)
        conflict: Conflict | None = None
        refused: Refused | None = None
        for obj in decision.create:
            try:
                self._create(ns, obj)
            except Conflict as exc:
                conflict = exc
            except Refused as exc:
                refused = refused or exc
        if refused is not None:
            self._report_refusal(ref, job, refused)
            return
        for event in decision.events:
            self.post_event(ref, event)
        if conflict is not None:
            raise conflict
        status = decision.status
        if decision.create:
            status = refusals.created_status(status, datetime.now(UTC).replace(microsecond=0))
        self._patch_status(ref, job, status)
        if decision.delete_job:
            try:
                self.custom.delete_namespaced_custom_object(
                    models.GROUP,
                    models.VERSION,
                    ns,
                    models.PLURAL,
                    ref.name,
                    propagation_policy="Background",
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _patch_status(
        self, ref: builders.JobRef, job: Obj, status: models.ElasticJobStatus
    ) -> None:
        old = job.get("status") or {}
        new = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        patch = merge_patch(old, new)
        if not patch:
            return
        try:
            self.custom.patch_namespaced_custom_object_status(
                models.GROUP,
                models.VERSION,
                ref.namespace,
                models.PLURAL,
                ref.name,
                {"status": patch},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to record
                raise

    def _report_refusal(self, ref: builders.JobRef, job: Obj, refused: Refused) -> None:
        """A refused child: a Warning event and ReplicaFailure on the job's previous status
        (this round's status would count the refused pods as launched; see refusals.py)."""
        log.warning("%s/%s: %s", ref.namespace, ref.name, refused.event.message)
        self.post_event(ref, refused.event)
        try:
            previous = models.ElasticJobStatus.model_validate(job.get("status") or {})
        except ValueError:
            previous = models.ElasticJobStatus()
        now = datetime.now(UTC).replace(microsecond=0)
        self._patch_status(ref, job, refusals.refused_status(previous, refused.event, now))
