"""A real Prometheus scraping the operator, and the chart's dashboard queried through it.

The binary is Debian's (package ``prometheus``, pinned): ``scripts/bootstrap.sh``, which
``make test`` runs, takes it out of the package into ``$ELASTICJOB_CACHE/tools``; a
missing one fails the test, saying so. :func:`prometheus_scraping` reaches the operator's
metrics Service from this machine, starts Prometheus on 127.0.0.1 scraping it every
second (as the chart's ServiceMonitor has the Prometheus Operator scrape it: the target
labels that clash with the series' own, ``namespace`` and ``job``, and its
``honor_labels``), and on exit stops every process it started, by pid, and checks it is
gone. :func:`query_dashboard` runs every query of a Grafana dashboard the way Grafana
would, for one namespace and one job.

The Service is reached as a user reaches one, through ``kubectl port-forward``, on any
cluster but the devcluster: its node agents serve no port-forward (nor exec), so there a
relay on 127.0.0.1 dials the Service's clusterIP from inside the cluster's network
namespace, as a pod would (the agents' own :class:`~elasticjob_devcluster.network.Proxy`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
from kube_helpers import Cluster

from elasticjob_devcluster import network
from elasticjob_devcluster.controlplane import DevCluster

SCRAPE_INTERVAL = "1s"
STOP_TIMEOUT = 10.0


def prometheus_binary() -> str:
    """Debian's prometheus, from PATH (make puts ``$ELASTICJOB_CACHE/tools`` on it) or the
    bootstrap's cache; none is a failure that says how to get it, never a skip."""
    found = shutil.which("prometheus")
    if found:
        return found
    cache = Path(os.environ.get("ELASTICJOB_CACHE", Path.home() / ".cache" / "elasticjob"))
    cached = cache / "tools" / "prometheus"
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    pytest.fail(
        f"no prometheus binary on PATH or at {cached}: scripts/bootstrap.sh (`make setup`, "
        "which `make test` runs) takes it out of Debian's prometheus package",
        pytrace=False,
    )


def stop_process(proc: subprocess.Popen[Any], what: str) -> None:
    """SIGTERM the process we started (by its pid), SIGKILL it if it outlives
    STOP_TIMEOUT, reap it, and check its pid is gone."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return
    raise AssertionError(f"{what} (pid {proc.pid}) is still there after it was stopped")


@contextlib.contextmanager
def forwarded_service(
    cluster: Cluster, dev: DevCluster | None, namespace: str, service: str, port: int
) -> Iterator[int]:
    """A port on 127.0.0.1 whose connections reach ``service:port``; yields the port."""
    if dev is not None:
        with _devcluster_relay(cluster, dev, namespace, service, port) as local:
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
        stop_process(proc, "kubectl port-forward")


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
def _devcluster_relay(
    cluster: Cluster, dev: DevCluster, namespace: str, service: str, port: int
) -> Iterator[int]:
    cfg = dev.config()
    assert cfg is not None, "the devcluster is not up"
    spec = cluster.core.read_namespaced_service(service, namespace).spec
    assert spec is not None and spec.cluster_ip, f"service {service} has no clusterIP"
    cluster_ip: str = spec.cluster_ip
    with socket.socket() as s:  # a free port (the relay binds it with SO_REUSEADDR)
        s.bind(("127.0.0.1", 0))
        local = int(s.getsockname()[1])
    relay = network.Proxy("", cfg.network)  # listens here, dials from the cluster netns
    try:
        relay.set_routes({("127.0.0.1", local): [(cluster_ip, port)]})
        with socket.create_connection(("127.0.0.1", local), timeout=5):
            pass  # it listens (set_routes skips an address it cannot bind)
        yield local
    finally:
        relay.close()


@dataclass
class Prometheus:
    """One running Prometheus: its HTTP API and its log."""

    url: str
    log: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; its ``data``, or an AssertionError with the error."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # a bad query answers 400 with the reason
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's vector: each series' labels and value."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def target_health(self) -> list[tuple[str, str]]:
        """Each active target's health and last scrape error."""
        data = self.api("targets", state="active")
        return [(t["health"], t["lastError"]) for t in data["activeTargets"]]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_prometheus(
    target: str,
    workdir: Path,
    *,
    target_labels: dict[str, str],
    honor_labels: bool,
    job_name: str = "elasticjob-operator",
    timeout: float = 60.0,
) -> Iterator[Prometheus]:
    """Prometheus on a free port of 127.0.0.1, scraping ``target`` (host:port) every
    second; yields it once it is ready, stops it (by pid) on exit."""
    data = workdir / "data"
    assert not data.exists(), f"{data}: a fresh TSDB, so every answer is from this run"
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": job_name,
                "honor_labels": honor_labels,
                "static_configs": [{"targets": [target], "labels": target_labels}],
            }
        ],
    }
    config_file = workdir / "prometheus.yml"
    config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log = workdir / "prometheus.log"
    cmd = [
        prometheus_binary(),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", log, proc)
    try:
        _wait_ready(prom, timeout)
        yield prom
    finally:
        stop_process(proc, "prometheus")


def _wait_ready(prom: Prometheus, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            raise AssertionError(
                f"prometheus exited ({prom.proc.returncode}) before it was ready:\n"
                + prom.log_tail()
            )
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready after {timeout:.0f}s:\n" + prom.log_tail())


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
    """Prometheus scraping ``service:port`` in ``namespace`` every second with target
    labels the Prometheus Operator gives a ServiceMonitor's endpoint (namespace, service,
    job = the Service's name) and that ServiceMonitor's ``honor_labels``."""
    labels = {"namespace": namespace, "service": service}
    with (
        forwarded_service(cluster, dev, namespace, service, port) as local,
        running_prometheus(
            f"127.0.0.1:{local}",
            workdir,
            target_labels=labels,
            honor_labels=honor_labels,
            job_name=service,
        ) as prom,
    ):
        yield prom


# -- the dashboard's queries ------------------------------------------------------------


@dataclass(frozen=True)
class DashboardAnswers:
    """What each query of a dashboard returned: panel targets by ``title [refId]`` (their
    vectors), template variables by name (their values)."""

    panels: dict[str, list[tuple[dict[str, str], float]]]
    variables: dict[str, list[str]]


def _regex_literal(value: str) -> str:
    """``value`` as Grafana puts a variable into a ``=~`` matcher: regex metacharacters
    escaped, the backslash doubled for PromQL's string."""
    return re.sub(r"[\\^$*+?.()|\[\]{}/]", lambda m: "\\\\" + m.group(0), value)


def substitute(expr: str, variables: dict[str, str], rate_interval: str) -> str:
    """Grafana's variables in ``expr``: each ``$name``/``${name}`` given its one value,
    ``$__rate_interval`` the interval given."""
    expr = expr.replace("$__rate_interval", rate_interval)
    expr = expr.replace("${__rate_interval}", rate_interval)
    for name, value in variables.items():
        replacement = _regex_literal(value).replace("\\", "\\\\")  # re.sub reads \ too
        expr = re.sub(rf"\$\{{{name}\}}|\${name}\b", replacement, expr)
    assert "$" not in expr.replace("$__", ""), f"a variable left in {expr!r}"
    return expr


def query_dashboard(
    prom: Prometheus,
    dashboard: dict[str, Any],
    variables: dict[str, str],
    rate_interval: str = "1m",
) -> DashboardAnswers:
    """Every query of ``dashboard`` as Grafana sends it with each variable set to one
    value: panel targets as instant queries, ``label_values(selector, label)`` variables
    as the label-values API."""
    panels: dict[str, list[tuple[dict[str, str], float]]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], variables, rate_interval)
            panels[f"{panel['title']} [{target['refId']}]"] = prom.query(expr)
    answers: dict[str, list[str]] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"].strip())
        assert found, f"variable {var['name']}: not label_values(...): {var['query']!r}"
        selector = substitute(found.group(1), variables, rate_interval)
        label = found.group(2)
        answers[var["name"]] = list(prom.api(f"label/{label}/values", **{"match[]": selector}))
    return DashboardAnswers(panels, answers)
