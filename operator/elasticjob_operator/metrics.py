"""Prometheus metrics of the operator: jobs by phase, worker restarts, hangs, reconcile
latency."""

from __future__ import annotations

from collections import Counter as _Tally
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

JOBS = Gauge("elasticjob_jobs", "ElasticJobs by phase.", ["phase"])
RESTARTS = Counter(
    "elasticjob_worker_restarts_total", "Worker pods replaced by the operator.", ["namespace"]
)
FAILURES = Counter(
    "elasticjob_worker_failures_total", "Worker pods seen failed or lost.", ["namespace"]
)
HANGS = Counter(
    "elasticjob_hangs_total",
    "Hangs the workers' agents detected (no training step for spec.hangTimeoutSeconds).",
    ["namespace"],
)
RECONCILE_SECONDS = Histogram(
    "elasticjob_reconcile_duration_seconds",
    "Time to observe one job, decide and apply the difference.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter(
    "elasticjob_reconcile_errors_total", "Reconciliations that raised.", ["namespace"]
)

PHASES = (
    "Created",
    "Running",
    "Restarting",
    "Scaling",
    "Queued",
    "Suspended",
    "Succeeded",
    "Failed",
)


def set_phases(phases: Iterable[str]) -> None:
    """Publish the phase census from one listing of all jobs."""
    tally = _Tally(phases)
    for phase in set(PHASES) | set(tally):
        JOBS.labels(phase=phase).set(tally.get(phase, 0))


def serve(port: int, addr: str = "127.0.0.1") -> None:
    start_http_server(port, addr=addr)
