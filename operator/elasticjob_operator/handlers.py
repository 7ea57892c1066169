"""kopf handlers: gather what is observed, call the pure decision, apply the difference.

Run with ``kopf run --standalone -m elasticjob_operator.handlers --all-namespaces``
(or ``--namespace N`` per watched namespace).

Triggers, each only marking the job due in the work queue (:mod:`workqueue`), whose
threads run :func:`reconcile_job`:
* any event of an ElasticJob (create, spec change, `kubectl scale`, the initial listing
  when the operator starts);
* any event of a worker pod (selected by our labels);
* a resync loop every ``ELASTICJOB_RESYNC_SECONDS`` over all jobs, which also mirrors
  training progress and enforces time-based rules (deadline, TTL, below-min grace).

No kopf timers, daemons or change handlers are used, so kopf puts no finalizer and no
annotation on the jobs: deleting a job never waits for the operator. Once it is gone the
operator deletes its children (selected by the job's uid label, the jobs deleted in one
burst together: :mod:`deletions`); the owner references let the garbage collector
remove whatever that misses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from elasticjob_operator import (
    builders,
    etcd_reader,
    etcd_secrets,
    etcd_users,
    metrics,
    models,
    network_policy,
    observe,
    rest,
    shared_etcd,
)
from elasticjob_operator.deletions import Deletions
from elasticjob_operator.kube import InvalidChild, Kube, load_config
from elasticjob_operator.reconcile import Config, invalid_spec, reconcile
from elasticjob_operator.workqueue import WorkQueue
from elasticjob_runtime.etcd_endpoints import TLSCredentials

log = logging.getLogger("elasticjob_operator")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number; set it to seconds, e.g. 10") from None


NAMESPACES = [n for n in os.environ.get("ELASTICJOB_NAMESPACES", "").split(",") if n.strip()]
RESYNC_SECONDS = _env_float("ELASTICJOB_RESYNC_SECONDS", 10.0)
# Threads that reconcile jobs (each job one at a time; one kept for urgent jobs): how
# many API requests at once (the chart's reconcileWorkers).
WORKERS = int(_env_float("ELASTICJOB_RECONCILE_WORKERS", 8))
if WORKERS < 2:
    raise SystemExit(f"ELASTICJOB_RECONCILE_WORKERS={WORKERS}: set it to 2 or more")
METRICS_PORT = int(_env_float("ELASTICJOB_METRICS_PORT", 8000))
# loopback unless told otherwise (the chart sets 0.0.0.0 inside the operator's pod)
METRICS_ADDR = os.environ.get("ELASTICJOB_METRICS_ADDR", "127.0.0.1")
CONFIG = Config(
    below_min_grace_seconds=_env_float("ELASTICJOB_BELOW_MIN_GRACE_SECONDS", 300.0),
    node_lost_grace_seconds=_env_float("ELASTICJOB_NODE_LOST_GRACE_SECONDS", 10.0),
)

_kube: Kube | None = None
_secrets: etcd_secrets.EtcdSecrets | None = None  # the jobs' etcd certificates (startup)
_queue: WorkQueue | None = None  # jobs due for a reconcile (startup)
_deletions: Deletions | None = None  # deleted jobs whose children are to go (startup)
_authority: etcd_secrets.SharedAuthority | None = None  # the shared etcd's CA (startup)
_users: etcd_users.EtcdUsers | None = None  # the shared etcd's users, if there is one
_stop = threading.Event()
_last_sweep = 0.0


def _validation_message(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"spec{'.' + where if where else ''}: {err['msg']}"


def reconcile_job(kube: Kube, namespace: str, name: str, read_progress: bool = False) -> None:
    """Observe one job and its children, decide, apply (the work queue's rounds; it
    runs one at a time per job)."""
    started = time.monotonic()
    try:
        _reconcile_locked(kube, namespace, name, read_progress)
    except Exception:
        metrics.RECONCILE_ERRORS.labels(namespace=namespace).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _reconcile_locked(kube: Kube, namespace: str, name: str, read_progress: bool) -> None:
    job = kube.get_job(namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        return
    meta = job["metadata"]
    ref = builders.JobRef(name=name, namespace=namespace, uid=meta["uid"])
    now = datetime.now(UTC)
    try:
        status = models.ElasticJobStatus.model_validate(job.get("status") or {})
    except ValidationError:
        log.warning("%s/%s: unreadable status, starting from an empty one", namespace, name)
        status = models.ElasticJobStatus()
    try:
        spec = models.ElasticJobSpec.model_validate(job.get("spec") or {})
    except ValidationError as exc:
        kube.apply(ref, job, invalid_spec(status, _validation_message(exc), now))
        return
    secrets = _secrets or etcd_secrets.EtcdSecrets(kube.rest)
    observed = kube.observe(ref)
    own = builders.etcd_name(name) in observed.deployments
    shared = shared_etcd.serves(spec, CONFIG.shared_etcd, runs_own_etcd=own)
    if read_progress and not status.finished and spec.rdzv_backend is not models.RdzvBackend.C10D:
        observed = _with_records(secrets, ref, spec, status, observed, shared is not None)
    decision = reconcile(ref, meta.get("generation"), spec, status, observed, now, CONFIG)
    if spec.provisions_etcd and not status.finished:
        # before the etcd and the workers that mount them are created; looked at again
        # then, so a client Secret deleted mid-job is issued again for the new pod
        mounts = any(obj.get("kind") in ("Pod", "Deployment") for obj in decision.create)
        if shared is not None and _users is not None and _authority is not None:
            _users.add_job(ref.uid)  # before the certificate that names its user
            secrets.ensure(ref, recheck=mounts, shared=_authority)
        else:
            secrets.ensure(ref, recheck=mounts)
    try:
        kube.apply(ref, job, decision)
    except InvalidChild as exc:  # a child the API server will never take: fail the job
        kube.apply(ref, job, invalid_spec(status, str(exc), now))
        return
    new = decision.status
    if new.restart_count > status.restart_count:
        metrics.RESTARTS.labels(namespace=namespace).inc(new.restart_count - status.restart_count)
    hang_delta = (new.hangs.count if new.hangs else 0) - (status.hangs.count if status.hangs else 0)
    if hang_delta > 0:
        metrics.HANGS.labels(namespace=namespace).inc(hang_delta)
    failed_delta = new.replica_statuses.worker.failed - status.replica_statuses.worker.failed
    if failed_delta > 0:
        metrics.FAILURES.labels(namespace=namespace).inc(failed_delta)
    for event in decision.events:
        log.info("%s/%s: %s: %s", namespace, name, event.reason, event.message)


def _with_records(
    secrets: etcd_secrets.EtcdSecrets,
    ref: builders.JobRef,
    spec: models.ElasticJobSpec,
    status: models.ElasticJobStatus,
    observed: observe.Observed,
    shared: bool,
) -> observe.Observed:
    """``observed`` with what the run published in its etcd: progress, node-memory,
    hang and divergence records. Nothing when its etcd cannot be read (not up yet, no Secret)."""
    run = models.run_id(ref.uid, status.incarnation)
    said = status.node_memory_fallback
    token: str | None = None
    tls: TLSCredentials | None
    try:
        if shared and _users is not None and _authority is not None:
            endpoint, tls = _users.endpoint, _authority.operator_tls
            token = _users.token()  # the gateway takes no user from a certificate
        else:
            endpoint = builders.rdzv_endpoint(ref, spec)
            tls = secrets.client_credentials(ref, spec)
    except (etcd_secrets.SecretsNotReady, etcd_users.SharedEtcdNotReady) as exc:
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
        memory_fallbacks=observe.memory_fallbacks_of(records.memory_fallbacks),
        hangs=observe.hangs_of(records.hangs),
        divergences=observe.divergences_of(records.divergences),
    )


def _tend_shared_etcd(users: etcd_users.EtcdUsers, kube: Kube) -> None:
    """Authentication on (again, if the etcd lost its data) and no user of a gone job."""
    if users.ensure_auth():
        log.info("shared etcd: authentication switched on; every job's user is added again")
    known = users.users()  # before the jobs: see EtcdUsers.remove_stale
    live = {j["metadata"]["uid"] for j in kube.list_jobs(NAMESPACES or None)}
    for user in users.remove_stale(known, live):
        log.info("shared etcd: removed user %s (its job is gone)", user)


def _sweep(kube: Kube, queue: WorkQueue) -> None:
    """The backstop: every job due, every RESYNC_SECONDS, with progress and time rules."""
    global _last_sweep
    while not _stop.is_set():
        try:
            jobs = kube.list_jobs(NAMESPACES or None)
            metrics.set_phases((j.get("status") or {}).get("phase") or "Created" for j in jobs)
            for job in jobs:
                m = job["metadata"]
                queue.add((m["namespace"], m["name"]), read_progress=True)
            _last_sweep = time.time()
        except Exception as exc:
            log.warning("resync failed: %s", exc)
        if _users is not None:
            try:
                _tend_shared_etcd(_users, kube)
            except Exception as exc:  # the etcd not up yet, or busy: next resync
                log.warning("shared etcd: %s", exc)
        _stop.wait(RESYNC_SECONDS)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _kube, CONFIG, _secrets, _queue, _users, _authority, _deletions
    settings.posting.level = logging.WARNING
    # One log line per decision (ours), not one per watch event or liveness probe.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # No CRD/namespace observation: the CRD is installed with the chart before the operator
    # starts, and the namespaces are given; so RBAC needs nothing cluster-scoped.
    settings.scanning.disabled = True
    # kopf's own calls and watches, bounded like ours (rest.py says why); a watch that
    # goes quiet is replaced after settings.watching.inactivity_timeout.
    settings.networking.connect_timeout = rest.CONNECT_TIMEOUT_S
    settings.networking.request_timeout = rest.READ_TIMEOUT_S
    settings.watching.connect_timeout = rest.CONNECT_TIMEOUT_S
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=models.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=models.GROUP, key="last-handled-configuration"
    )
    try:
        CONFIG = replace(
            CONFIG,
            network_policy=network_policy.peer_from_env(os.environ),
            shared_etcd=shared_etcd.from_env(os.environ),
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    load_config()
    _kube = Kube(network_policies=CONFIG.network_policy is not None)
    _secrets = etcd_secrets.EtcdSecrets(_kube.rest)
    if CONFIG.shared_etcd is not None:
        try:
            _authority = _secrets.ensure_shared(CONFIG.shared_etcd)
        except etcd_secrets.SecretsNotReady as exc:
            raise SystemExit(f"the shared etcd's certificates: {exc}") from None
        shared = CONFIG.shared_etcd
        _users = etcd_users.EtcdUsers(
            shared.endpoint,
            _authority.operator_tls,
            _authority.root_password,
            secret=f"{shared.namespace}/{shared.secret}",
        )
    _stop.clear()
    if METRICS_PORT:
        metrics.serve(METRICS_PORT, METRICS_ADDR)
    kube = _kube
    _queue = WorkQueue(lambda key, progress: reconcile_job(kube, *key, progress), WORKERS)
    _queue.start()
    _deletions = Deletions(lambda namespace, uids: _delete_children(kube, namespace, uids))
    _deletions.start()
    threading.Thread(
        target=_sweep, args=(_kube, _queue), name="elasticjob-resync", daemon=True
    ).start()


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    _stop.set()
    if _queue is not None:
        _queue.stop()
    if _deletions is not None:
        _deletions.stop()


@kopf.on.probe(id="lastResync")
def last_resync(**_: Any) -> float:
    return _last_sweep


def is_own_status_echo(type: str | None, body: Mapping[str, Any]) -> bool:
    """A MODIFIED event for a spec the operator has already acted on: our own status
    write coming back (or a label change). Reacting would only re-read the same world."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    return (
        type == "MODIFIED"
        and meta.get("generation") is not None
        and meta.get("generation") == status.get("observedGeneration")
        and not meta.get("deletionTimestamp")
    )


@kopf.on.event(models.GROUP, models.VERSION, models.PLURAL)
async def job_event(
    type: str, name: str, namespace: str | None, body: Mapping[str, Any], **_: Any
) -> None:
    """Async and quick: it only marks the job due (see workqueue.py). A change of the job
    itself (a spec change, a scale) goes ahead of the pod events of other jobs."""
    if type == "DELETED":
        uid = (body.get("metadata") or {}).get("uid")
        if _deletions is not None and namespace and uid:
            _deletions.add(namespace, uid)
        return
    if _queue is not None and namespace and not is_own_status_echo(type, body):
        _queue.add((namespace, name), urgent=type == "MODIFIED")


def _delete_children(kube: Kube, namespace: str, uids: list[str]) -> None:
    """What a deleted job leaves: its children (a burst of deleted jobs' at once) and its
    shared etcd user, whose certificate then opens nothing."""
    try:
        kube.delete_children(namespace, uids)
    except Exception as exc:  # the garbage collector still removes them, only slower
        log.warning("%s: deleting %d deleted jobs' children failed: %s", namespace, len(uids), exc)
    if _users is not None:
        for uid in uids:
            try:
                _users.remove_job(uid)
            except Exception as exc:  # the resync's sweep removes it later
                log.warning("%s: removing the etcd user of job %s failed: %s", namespace, uid, exc)


@kopf.on.event(
    "",
    "v1",
    "pods",
    labels={builders.LABEL_JOB: kopf.PRESENT, builders.LABEL_ROLE: builders.ROLE_WORKER},
)
async def pod_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    if _queue is not None and namespace:
        _queue.add((namespace, labels[builders.LABEL_JOB]))
