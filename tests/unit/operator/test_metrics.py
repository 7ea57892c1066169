"""The operator's Prometheus endpoint serves the job census, restarts and reconcile latency."""

from __future__ import annotations

import socket
import urllib.request

from elasticjob_operator import metrics


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
