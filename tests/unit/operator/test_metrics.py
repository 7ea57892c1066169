"""The operator's Prometheus endpoint serves the job census, restarts and reconcile latency."""

from __future__ import annotations

import socket
import urllib.request
from datetime import UTC, datetime

from prometheus_client import REGISTRY, generate_latest

from elasticjob_operator import metrics, models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_endpoint_serves_phases_restarts_and_latency() -> None:
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    metrics.set_phases(["Running", "Running", "Failed"])
    metrics.RESTARTS.labels(namespace="ml").inc(2)
    metrics.RECONCILE_SECONDS.observe(0.02)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'elasticjob_jobs{phase="Running"} 2.0' in body
    assert 'elasticjob_jobs{phase="Failed"} 1.0' in body
    assert 'elasticjob_jobs{phase="Succeeded"} 0.0' in body
    assert 'elasticjob_worker_restarts_total{namespace="ml"}' in body
    assert "elasticjob_reconcile_duration_seconds_count" in body
    metrics.set_phases([])
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'elasticjob_jobs{phase="Running"} 0.0' in body


def goodput(recoveries: dict[str, int], pause: float) -> models.Goodput:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return models.Goodput(
        run_id="uid-1",
        ratio=0.9,
        percent="90.0%",
        wall_seconds=100,
        training_seconds=90,
        waiting_seconds=4,
        startup_seconds=3,
        paused_seconds={"failure": 2},
        lost_seconds=0.5,
        checkpoint_seconds=0.5,
        recoveries=recoveries,
        longest_pause_seconds=pause,
        through_time=at,
        last_recovery=models.LastRecovery(cause="failure", pause_seconds=pause, step=7, time=at),
    )


def status(g: models.Goodput | None) -> models.ElasticJobStatus:
    progress = models.Progress(step=7, samples_per_second=12.5)
    return models.ElasticJobStatus(goodput=g, progress=progress)


def scrape() -> str:
    return generate_latest(REGISTRY).decode()


def test_a_jobs_goodput_is_exported_per_bucket_and_cause_and_goes_with_the_job() -> None:
    metrics.job_round("ml", "gp", status(None), status(goodput({"failure": 1}, 1.5)))
    body = scrape()
    assert 'elasticjob_job_goodput_ratio{job="gp",namespace="ml"} 0.9' in body
    assert 'elasticjob_job_seconds_total{bucket="paused",job="gp",namespace="ml"} 2.0' in body
    assert 'elasticjob_job_seconds_total{bucket="training",job="gp",namespace="ml"} 90.0' in body
    assert 'elasticjob_job_recoveries_total{cause="failure",job="gp",namespace="ml"} 1.0' in body
    assert 'elasticjob_job_samples_per_second{job="gp",namespace="ml"} 12.5' in body
    pause = 'elasticjob_job_recovery_pause_seconds_count{cause="failure",job="gp",namespace="ml"}'
    assert f"{pause} 1.0" in body
    # the same status read again: the recovery is not observed twice
    same = status(goodput({"failure": 1}, 1.5))
    metrics.job_round("ml", "gp", same, same)
    assert f"{pause} 1.0" in scrape()
    metrics.forget_job("ml", "gp")
    assert 'job="gp"' not in scrape()
