"""One round of one job: observe, decide, apply.

Observe reads the job, its children and, on a resync, what its run published in its etcd,
and reads the clock once; decide is :func:`~elasticjob_operator.reconcile.reconcile`,
pure; apply carries the :class:`~elasticjob_operator.decision.Decision` out in its order
(the etcd credentials, then the children, events and status through
:meth:`~elasticjob_operator.kube.Kube.apply`). What the API server answers back (a child
refused, or invalid) is decided on the same way, with the same clock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pydantic import ValidationError

from elasticjob_operator import builders, metrics, models, observe, refusals
from elasticjob_operator.decision import Credentials, Decision
from elasticjob_operator.etcd import leaving as etcd_leaving
from elasticjob_operator.etcd import reader as etcd_reader
from elasticjob_operator.etcd.secrets import SecretsNotReady
from elasticjob_operator.etcd.shared import SharedEtcd
from elasticjob_operator.etcd.users import SharedEtcdNotReady
from elasticjob_operator.kube import InvalidChild
from elasticjob_operator.kueue.priority import priority_ref
from elasticjob_operator.kueue.workload import queue_of
from elasticjob_operator.reconcile import invalid_spec, reconcile, shared_etcd_of
from elasticjob_runtime.etcd.endpoints import TLSCredentials

if TYPE_CHECKING:
    from elasticjob_operator.assembly import Operator

log = logging.getLogger("elasticjob_operator")


def validation_message(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"spec{'.' + where if where else ''}: {err['msg']}"


def reconcile_job(op: Operator, namespace: str, name: str, read_progress: bool = False) -> None:
    """Observe one job and its children, decide, apply (the work queue's rounds; it
    runs one at a time per job)."""
    started = time.monotonic()
    try:
        _round(op, namespace, name, read_progress)
    except Exception:
        metrics.RECONCILE_ERRORS.labels(namespace=namespace).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _round(op: Operator, namespace: str, name: str, read_progress: bool) -> None:
    kube = op.kube
    job = kube.get_job(namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        metrics.forget_job(namespace, name)
        return
    meta = job["metadata"]
    ref = builders.JobRef(name=name, namespace=namespace, uid=meta["uid"])
    now = datetime.now(UTC)  # the round's one reading of the clock
    try:
        status = models.ElasticJobStatus.model_validate(job.get("status") or {})
    except ValidationError:
        log.warning("%s/%s: unreadable status, starting from an empty one", namespace, name)
        status = models.ElasticJobStatus()
    try:
        spec = models.ElasticJobSpec.model_validate(job.get("spec") or {})
    except ValidationError as exc:
        kube.apply(ref, job, invalid_spec(status, validation_message(exc), now))
        return
    queue = queue_of(meta.get("labels"))
    observed = kube.observe(
        ref,
        queued=queue is not None and op.config.kueue,
        priority=priority_ref(meta.get("labels"), spec),
    )
    listed = {p.uid: p.index for p in observed.pods if p.uid}
    news = op.pods.settle((namespace, name), listed, time.monotonic())
    observed = replace(
        observed,
        taken=news.taken,
        departing=news.departing,
        created=observe.timestamp(meta.get("creationTimestamp")),
    )
    shared = shared_etcd_of(ref, spec, observed, op.config)
    if read_progress and not status.finished and spec.rdzv_backend is not models.RdzvBackend.C10D:
        observed = _with_records(op, ref, spec, status, observed, shared)
    decision = reconcile(
        ref, meta.get("generation"), spec, status, observed, now, op.config, shared, queue
    )
    if decision.credentials is not None:
        _ensure_credentials(op, ref, decision.credentials)
    if decision.leaving and spec.rdzv_backend is models.RdzvBackend.ETCD_V3:
        _mark_leaving(op, ref, spec, decision, shared)  # before their pods are deleted
    try:
        refused = kube.apply(ref, job, decision)
    except InvalidChild as exc:  # a child the API server will never take: fail the job
        kube.apply(ref, job, invalid_spec(status, str(exc), now))
        return
    if refused is not None:
        log.warning("%s/%s: %s", namespace, name, refused.message)
        kube.apply(ref, job, refusals.refused(status, refused, now.replace(microsecond=0)))
        return
    _count(ref, status, decision)


def _ensure_credentials(op: Operator, ref: builders.JobRef, step: Credentials) -> None:
    """The decision's first step: the job's etcd certificates, before the etcd and the
    workers that mount them are created."""
    if step.shared and op.shared is not None:
        op.shared.users.add_job(ref.uid)  # before the certificate that names its user
        op.secrets.ensure(ref, recheck=step.recheck, shared=op.shared.authority)
    else:
        op.secrets.ensure(ref, recheck=step.recheck)


def _count(ref: builders.JobRef, status: models.ElasticJobStatus, decision: Decision) -> None:
    """The round's metrics and one log line per decision."""
    namespace = ref.namespace
    new = decision.status
    metrics.job_round(namespace, ref.name, status, new)
    if new.restart_count > status.restart_count:
        metrics.RESTARTS.labels(namespace=namespace).inc(new.restart_count - status.restart_count)
    hang_delta = (new.hangs.count if new.hangs else 0) - (status.hangs.count if status.hangs else 0)
    if hang_delta > 0:
        metrics.HANGS.labels(namespace=namespace).inc(hang_delta)
    failed_delta = new.replica_statuses.worker.failed - status.replica_statuses.worker.failed
    if failed_delta > 0:
        metrics.FAILURES.labels(namespace=namespace).inc(failed_delta)
    for event in decision.events:
        log.info("%s/%s: %s: %s", namespace, ref.name, event.reason, event.message)


def _with_records(
    op: Operator,
    ref: builders.JobRef,
    spec: models.ElasticJobSpec,
    status: models.ElasticJobStatus,
    observed: observe.Observed,
    shared: SharedEtcd | None,
) -> observe.Observed:
    """``observed`` with what the run published in its etcd: progress, node-memory,
    hang and divergence records. Nothing when its etcd cannot be read (not up yet, no Secret)."""
    run = models.run_id(ref.uid, status.incarnation)
    said = status.node_memory_fallback
    try:
        endpoint, tls, token = _run_etcd(op, ref, spec, shared)
    except (SecretsNotReady, SharedEtcdNotReady) as exc:
        log.debug("%s/%s: no progress: %s", ref.namespace, ref.name, exc)
        return observed
    records = etcd_reader.read_run_records(
        endpoint,
        run,
        # said once per run: no need to look again
        memory_fallbacks=said is None or said.run_id != run,
        tls=tls,
        token=token,
    )
    return replace(
        observed,
        progress=observe.progress_of(records.progress),
        ledger=observe.ledger_of(records.progress),
        memory_fallbacks=observe.memory_fallbacks_of(records.memory_fallbacks),
        hangs=observe.hangs_of(records.hangs),
        divergences=observe.divergences_of(records.divergences),
    )


def _run_etcd(
    op: Operator, ref: builders.JobRef, spec: models.ElasticJobSpec, shared: SharedEtcd | None
) -> tuple[str, TLSCredentials | None, str | None]:
    """Where the job's run keeps its records and how the operator gets in: endpoint, TLS
    credentials, and on the shared etcd root's auth token (the gateway takes no user from
    a certificate). SecretsNotReady or SharedEtcdNotReady when it cannot (yet)."""
    if shared is not None and op.shared is not None:
        users = op.shared.users
        return users.endpoint, op.shared.authority.operator_tls, users.token()
    return builders.rdzv_endpoint(ref, spec), op.secrets.client_credentials(ref, spec), None


def _mark_leaving(
    op: Operator,
    ref: builders.JobRef,
    spec: models.ElasticJobSpec,
    decision: Decision,
    shared: SharedEtcd | None,
) -> None:
    """The nodes of the running workers this round deletes in a scale-down, marked
    leaving together (etcd/leaving.py): their peers regroup once, not once per SIGTERM.
    Nothing is marked when the etcd cannot be reached; the pods are deleted anyway."""
    run = models.run_id(ref.uid, decision.status.incarnation)
    try:
        endpoint, tls, token = _run_etcd(op, ref, spec, shared)
    except (SecretsNotReady, SharedEtcdNotReady) as exc:
        log.info("%s/%s: no leaving marks: %s", ref.namespace, ref.name, exc)
        return
    marked = etcd_leaving.mark_leaving(endpoint, run, decision.leaving, tls=tls, token=token)
    if marked:
        log.info("%s/%s: marked leaving: %s", ref.namespace, ref.name, ", ".join(marked))
