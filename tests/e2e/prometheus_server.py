"""The e2e tests' Prometheus: a real one scraping the operator's metrics Service
(``elasticjob_devcluster.prometheus`` starts it, queries it and stops it; ``make demo``
uses the same).

A missing binary fails the test, saying how to get it, never skips it.
:func:`prometheus_scraping` reaches the operator's metrics Service from this machine as a
user reaches one, through ``kubectl port-forward``, on any cluster but the devcluster:
its node agents serve no port-forward (nor exec), so there a relay on 127.0.0.1 dials
the Service's clusterIP from inside the cluster's network namespace, as a pod would. It
stops every process it started, by pid, and checks it is gone.
"""

from __future__ import annotations

import contextlib
import re
import selectors
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from kube_helpers import Cluster

from elasticjob_devcluster import prometheus
from elasticjob_devcluster.controlplane import DevCluster
from elasticjob_devcluster.prometheus import Prometheus


def prometheus_binary() -> str:
    """Debian's prometheus (:func:`~elasticjob_devcluster.prometheus.find_binary`); none
    is a failure that says how to get it, never a skip."""
    try:
        return prometheus.find_binary()
    except prometheus.PrometheusMissing as e:
        pytest.fail(str(e), pytrace=False)


@contextlib.contextmanager
def forwarded_service(
    cluster: Cluster, dev: DevCluster | None, namespace: str, service: str, port: int
) -> Iterator[int]:
    """A port on 127.0.0.1 whose connections reach ``service:port``; yields the port."""
    if dev is not None:
        spec = cluster.core.read_namespaced_service(service, namespace).spec
        assert spec is not None and spec.cluster_ip, f"service {service} has no clusterIP"
        with prometheus.devcluster_relay(dev, spec.cluster_ip, port) as local:
            yield local
        return
    with _port_forward(cluster, namespace, service, port) as local:
        yield local


@contextlib.contextmanager
def _port_forward(cluster: Cluster, namespace: str, service: str, port: int) -> Iterator[int]:
    cmd = [
        "kubectl",
        f"--kubeconfig={cluster.kubeconfig}",
        "-n",
        namespace,
        "port-forward",
        "--address=127.0.0.1",
        f"svc/{service}",
        f":{port}",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    try:
        local = _forwarded_port(proc, port)
        # kubectl says "Handling connection" per scrape: read on, or a full pipe stops it
        threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
        yield local
    finally:
        prometheus.stop_process(proc, "kubectl port-forward")


def _drain(stream: IO[str] | None) -> None:
    with contextlib.suppress(OSError, ValueError):
        for _ in stream or ():
            pass


def _forwarded_port(proc: subprocess.Popen[str], port: int, timeout: float = 60.0) -> int:
    """The local port from kubectl's ``Forwarding from 127.0.0.1:LOCAL -> PORT``."""
    assert proc.stdout is not None
    said: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break  # kubectl ended
            said.append(line)
            found = re.search(rf"Forwarding from 127\.0\.0\.1:(\d+) -> {port}\b", line)
            if found:
                return int(found.group(1))
    raise AssertionError(f"kubectl port-forward gave no local port: {''.join(said)!r}")


@contextlib.contextmanager
def prometheus_scraping(
    cluster: Cluster,
    dev: DevCluster | None,
    namespace: str,
    service: str,
    port: int,
    workdir: Path,
    *,
    honor_labels: bool,
) -> Iterator[Prometheus]:
    """Prometheus scraping ``service:port`` in ``namespace`` every second as a
    ServiceMonitor with ``honor_labels`` has it scraped
    (:func:`~elasticjob_devcluster.prometheus.scraping_service`)."""
    binary = prometheus_binary()
    with (
        forwarded_service(cluster, dev, namespace, service, port) as local,
        prometheus.scraping_service(
            f"127.0.0.1:{local}",
            workdir,
            namespace=namespace,
            service=service,
            honor_labels=honor_labels,
            binary=binary,
        ) as prom,
    ):
        yield prom
