"""The kopf handlers: each event only marks its job due; the assembled operator does the rest.

Run with ``kopf run --standalone -m elasticjob_operator.handlers --all-namespaces``
(or ``--namespace N`` per watched namespace).

The operator is assembled once, at startup (:mod:`assembly`); the handlers only hand
it their events. Triggers, each only marking the job due in the work queue
(:mod:`workqueue`), whose threads run a round (:mod:`job_round`):
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
import time
from collections.abc import Mapping
from typing import Any

import kopf

from elasticjob_operator import builders, metrics, models, rest
from elasticjob_operator.assembly import Operator, assemble
from elasticjob_operator.kueue import workload as kueue_workload
from elasticjob_operator.observe import worker_labels
from elasticjob_operator.pod_watch import taken_index
from elasticjob_operator.settings import from_env, kueue_enabled

log = logging.getLogger("elasticjob_operator")

# the running operator (startup): the one thing kopf's module-level handlers share
_operator: Operator | None = None


# An operator that starts while the API server cannot be reached (a control-plane restart,
# an upgrade) tries again soon: kopf retries a failed startup only after a minute, and the
# liveness probe kills the pod before that, so the jobs waited a minute for nothing.
STARTUP_RETRY_FIRST_S = 1.0
STARTUP_RETRY_MAX_S = 10.0


def startup_retry_delay(retry: int) -> float:
    """Seconds before the next startup attempt after ``retry + 1`` failed ones: doubling
    from 1 s (an API server back within seconds is used at once), at most 10 s."""
    return min(STARTUP_RETRY_MAX_S, STARTUP_RETRY_FIRST_S * 2.0**retry)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, retry: int = 0, **_: Any) -> None:
    global _operator
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
        operator = assemble(from_env(os.environ))
    except Exception as exc:  # the API server unreachable; a bad setting is SystemExit
        delay = startup_retry_delay(retry)
        raise kopf.TemporaryError(f"cannot start yet: {exc}", delay=delay) from exc
    operator.start()
    _operator = operator


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    if _operator is not None:
        _operator.stop()


@kopf.on.probe(id="lastResync")
def last_resync(**_: Any) -> float:
    return _operator.last_sweep if _operator is not None else 0.0


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
        if _operator is not None and namespace and uid:
            _operator.deletions.add(namespace, uid)
            _operator.pods.forget((namespace, name))  # no round runs for it again
        if namespace:
            metrics.forget_job(namespace, name)  # its goodput series go with it
        return
    if _operator is not None and namespace and not is_own_status_echo(type, body):
        _operator.queue.add((namespace, name), urgent=type == "MODIFIED")


@kopf.on.event(
    "",
    "v1",
    "pods",
    labels={builders.LABEL_JOB: kopf.PRESENT, builders.LABEL_ROLE: builders.ROLE_WORKER},
)
async def pod_event(
    type: str, labels: Mapping[str, str], namespace: str | None, body: Mapping[str, Any], **_: Any
) -> None:
    if _operator is not None and namespace:
        key = (namespace, labels[builders.LABEL_JOB])
        uid = (body.get("metadata") or {}).get("uid") or ""
        if type == "DELETED":  # its last state says whether the cluster took it
            _operator.pods.deleted(key, uid, taken_index(body), time.monotonic())
        elif (worker := worker_labels(body)) is not None:
            _operator.pods.saw(key, uid, worker[0])
        _operator.queue.add(key)


async def workload_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    """A job's Kueue Workload changed (admitted, evicted): its job is due."""
    if _operator is not None and namespace:
        _operator.queue.add((namespace, labels[builders.LABEL_JOB]))


# Kueue's Workloads are watched only when the chart enables Kueue: the operator is granted
# nothing on them otherwise, and the cluster may not serve them at all.
if kueue_enabled(os.environ):
    kopf.on.event(
        kueue_workload.GROUP,
        kueue_workload.VERSION,
        "workloads",
        labels={builders.LABEL_JOB: kopf.PRESENT, builders.LABEL_MANAGED_BY: builders.MANAGER},
    )(workload_event)
