"""Prometheus metrics of the operator: jobs by phase, worker restarts, hangs, reconcile
latency, and each job's goodput (docs/goodput.md): its ratio, its seconds by bucket and
its recoveries by cause (counters over the job's current run), the pause of each
recovery (a histogram) and its samples per second. A job's series go when the job does
(:func:`forget_job`), so their number is bounded by the jobs that exist."""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from collections.abc import Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elasticjob_operator import models

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

RECOVERY_PAUSE_SECONDS = Histogram(
    "elasticjob_job_recovery_pause_seconds",
    "Each recovery's pause, from its last step to the next less one step (the newest one "
    "when a read finds several).",
    ["namespace", "job", "cause"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
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


class GoodputCollector(Collector):
    """Each job's goodput as its status last said it, read at every scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], tuple[models.Goodput | None, float | None]] = {}

    def update(
        self, namespace: str, job: str, goodput: models.Goodput | None, rate: float | None
    ) -> None:
        with self._lock:
            self._jobs[namespace, job] = (goodput, rate)

    def forget(self, namespace: str, job: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, job), None)

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "job"]
        ratio = GaugeMetricFamily(
            "elasticjob_job_goodput_ratio", "Training time over wall time.", labels=labels
        )
        seconds = CounterMetricFamily(
            "elasticjob_job_seconds",
            "Wall time by bucket: training, waiting, startup, paused, lost, checkpoint.",
            labels=[*labels, "bucket"],
        )
        paused = CounterMetricFamily(
            "elasticjob_job_paused_seconds",
            "Recoveries' pauses by cause.",
            labels=[*labels, "cause"],
        )
        recoveries = CounterMetricFamily(
            "elasticjob_job_recoveries", "Recoveries by cause.", labels=[*labels, "cause"]
        )
        samples = GaugeMetricFamily(
            "elasticjob_job_samples_per_second", "Training samples per second.", labels=labels
        )
        with self._lock:
            jobs = dict(self._jobs)
        for (namespace, job), (goodput, rate) in sorted(jobs.items()):
            if rate is not None:
                samples.add_metric([namespace, job], rate)
            if goodput is None:
                continue
            ratio.add_metric([namespace, job], goodput.ratio)
            for bucket, value in _buckets(goodput):
                seconds.add_metric([namespace, job, bucket], value)
            for cause, value in goodput.paused_seconds.items():
                paused.add_metric([namespace, job, cause], value)
            for cause, count in goodput.recoveries.items():
                recoveries.add_metric([namespace, job, cause], count)
        yield from (ratio, seconds, paused, recoveries, samples)


def _buckets(g: models.Goodput) -> list[tuple[str, float]]:
    return [
        ("training", g.training_seconds),
        ("waiting", g.waiting_seconds),
        ("startup", g.startup_seconds),
        ("paused", sum(g.paused_seconds.values())),
        ("lost", g.lost_seconds),
        ("checkpoint", g.checkpoint_seconds),
    ]


GOODPUT = GoodputCollector()
REGISTRY.register(GOODPUT)
_paused_causes: dict[tuple[str, str], set[str]] = {}  # the pause histogram's labels per job
_paused_lock = threading.Lock()


def job_round(
    namespace: str, job: str, before: models.ElasticJobStatus, after: models.ElasticJobStatus
) -> None:
    """A job's goodput series after one of its rounds: its latest figures, and the pause
    of a recovery its status counts for the first time."""
    rate = after.progress.samples_per_second if after.progress is not None else None
    GOODPUT.update(namespace, job, after.goodput, rate)
    new, old = after.goodput, before.goodput
    same_run = old is not None and new is not None and old.run_id == new.run_id
    counted = sum(old.recoveries.values()) if old is not None and same_run else 0
    if new is None or new.last_recovery is None or sum(new.recoveries.values()) <= counted:
        return
    last = new.last_recovery
    with _paused_lock:
        _paused_causes.setdefault((namespace, job), set()).add(last.cause)
    RECOVERY_PAUSE_SECONDS.labels(namespace, job, last.cause).observe(last.pause_seconds)


def forget_job(namespace: str, job: str) -> None:
    """The job is gone: its series go with it."""
    GOODPUT.forget(namespace, job)
    with _paused_lock:
        causes = _paused_causes.pop((namespace, job), set())
    for cause in causes:
        RECOVERY_PAUSE_SECONDS.remove(namespace, job, cause)


def serve(port: int, addr: str = "127.0.0.1") -> None:
    start_http_server(port, addr=addr)
