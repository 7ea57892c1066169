"""A real Prometheus scraping the operator, and the chart's Grafana dashboard queried
through it: for the e2e tests (``tests/e2e/prometheus_server.py``) and ``make demo``
(``scripts/demo.py``, which draws the answers: ``dashboard_picture.py``).

The binary is Debian's (package ``prometheus``, pinned): ``scripts/bootstrap.sh`` takes
it out of the package into ``$ELASTICJOB_CACHE/tools``; :func:`find_binary` raises
:class:`PrometheusMissing`, saying so, when there is none. :func:`scraping_service`
starts it on 127.0.0.1 scraping one address every second as the chart's ServiceMonitor
has the Prometheus Operator scrape the operator's metrics Service (the target labels
that clash with the series' own, ``namespace`` and ``job``, and its ``honor_labels``:
:func:`service_monitor_endpoint`), and on exit stops it by its pid and checks it is
gone. :func:`query_dashboard` runs every query of a Grafana dashboard the way Grafana
would for one namespace and one job, as instant queries; :func:`query_dashboard_range`
the same over a time range, as Grafana's time-series panels ask.

On the devcluster, whose node agents serve no ``kubectl port-forward``,
:func:`devcluster_relay` gives a port on 127.0.0.1 that reaches a Service's clusterIP
from inside the cluster's network namespace, as a pod would (the agents' own
:class:`~elasticjob_devcluster.network.Proxy`). Nothing here needs the kubernetes client.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from elasticjob_devcluster import network
from elasticjob_devcluster.controlplane import free_ports

if TYPE_CHECKING:
    from elasticjob_devcluster.controlplane import DevCluster

SCRAPE_INTERVAL = "1s"
STOP_TIMEOUT = 10.0

Labels = dict[str, str]
Sample = tuple[Labels, float]  # one series of an instant vector: its labels and value
Points = list[tuple[float, float]]  # (unix time, value)
RangeSeries = tuple[Labels, Points]  # one series of a range query's matrix


class PrometheusError(RuntimeError):
    """Prometheus refused a query, did not start, or outlived its stop."""


class PrometheusMissing(PrometheusError):
    """No prometheus binary: the message says how to get one."""


def find_binary() -> str:
    """Debian's prometheus, from PATH (make puts ``$ELASTICJOB_CACHE/tools`` on it) or the
    bootstrap's cache."""
    found = shutil.which("prometheus")
    if found:
        return found
    cache = Path(os.environ.get("ELASTICJOB_CACHE", Path.home() / ".cache" / "elasticjob"))
    cached = cache / "tools" / "prometheus"
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    raise PrometheusMissing(
        f"no prometheus binary on PATH or at {cached}: scripts/bootstrap.sh (`make setup`, "
        "which `make test` runs) takes it out of Debian's prometheus package"
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
    raise PrometheusError(f"{what} (pid {proc.pid}) is still there after it was stopped")


@contextlib.contextmanager
def devcluster_relay(dev: DevCluster, cluster_ip: str, port: int) -> Iterator[int]:
    """A port on 127.0.0.1 whose connections reach ``cluster_ip:port`` of the devcluster
    ``dev`` (a Service's), dialled from its network namespace; yields the port."""
    cfg = dev.config()
    if cfg is None:
        raise PrometheusError(f"the devcluster in {dev.dir} is not up")
    local = free_ports(1)[0]
    relay = network.Proxy("", cfg.network)  # listens here, dials from the cluster netns
    try:
        relay.set_routes({("127.0.0.1", local): [(cluster_ip, port)]})
        with socket.create_connection(("127.0.0.1", local), timeout=5):
            pass  # it listens (set_routes skips an address it cannot bind)
        yield local
    finally:
        relay.close()


def service_monitor_endpoint(chart: Path, helm: str = "helm") -> dict[str, Any]:
    """The one endpoint of ``chart``'s ServiceMonitor (its ``port`` name, its
    ``honorLabels``), rendered by ``helm template`` with the metrics Service on."""
    out = subprocess.run(
        [
            helm,
            "template",
            "rel",
            str(chart),
            "--set",
            "metrics.service.enabled=true",
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--show-only",
            "templates/servicemonitor.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise PrometheusError(f"helm template {chart} failed:\n{out.stderr}")
    (endpoint,) = yaml.safe_load(out.stdout)["spec"]["endpoints"]
    assert isinstance(endpoint, dict)
    return endpoint


@dataclass
class Prometheus:
    """One running Prometheus: its HTTP API and its log."""

    url: str
    log: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; its ``data``, or a PrometheusError with the error."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # a bad query answers 400 with the reason
            body = json.load(e)
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus refused {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[Sample]:
        """An instant query's vector: each series' labels and value."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr}: a {data['resultType']}, not a vector: {data}")
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[RangeSeries]:
        """A range query's matrix (``/api/v1/query_range``, unix times, ``step``
        seconds): each series' labels and its (time, value) points."""
        data = self.api("query_range", query=expr, start=str(start), end=str(end), step=str(step))
        return matrix(expr, data)

    def target_health(self) -> list[tuple[str, str]]:
        """Each active target's health and last scrape error."""
        data = self.api("targets", state="active")
        return [(t["health"], t["lastError"]) for t in data["activeTargets"]]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def matrix(expr: str, data: dict[str, Any]) -> list[RangeSeries]:
    """A range query's ``data``: each series' labels and its points (values as floats:
    Prometheus writes them as strings, ``NaN`` and ``+Inf`` included)."""
    if data["resultType"] != "matrix":
        raise PrometheusError(f"{expr}: a {data['resultType']}, not a matrix: {data}")
    return [(s["metric"], [(float(t), float(v)) for t, v in s["values"]]) for s in data["result"]]


@contextlib.contextmanager
def running_prometheus(
    target: str,
    workdir: Path,
    *,
    target_labels: dict[str, str],
    honor_labels: bool,
    job_name: str = "elasticjob-operator",
    binary: str | None = None,
    timeout: float = 60.0,
) -> Iterator[Prometheus]:
    """Prometheus (``binary``, else :func:`find_binary`'s) on a free port of 127.0.0.1,
    scraping ``target`` (host:port) every second into a fresh TSDB under ``workdir``;
    yields it once it is ready, stops it (by pid) on exit."""
    binary = binary or find_binary()
    data = workdir / "data"
    if data.exists():
        raise PrometheusError(f"{data}: not a fresh TSDB, so not every answer is of this run")
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
    port = free_ports(1)[0]
    log = workdir / "prometheus.log"
    cmd = [
        binary,
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
            raise PrometheusError(
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
    raise PrometheusError(f"prometheus not ready after {timeout:.0f}s:\n" + prom.log_tail())


@contextlib.contextmanager
def scraping_service(
    target: str,
    workdir: Path,
    *,
    namespace: str,
    service: str,
    honor_labels: bool,
    binary: str | None = None,
) -> Iterator[Prometheus]:
    """Prometheus scraping ``target``, the address that reaches ``service`` in
    ``namespace``, every second with the target labels the Prometheus Operator gives a
    ServiceMonitor's endpoint (namespace, service, job = the Service's name) and that
    ServiceMonitor's ``honor_labels``."""
    labels = {"namespace": namespace, "service": service}
    with running_prometheus(
        target,
        workdir,
        target_labels=labels,
        honor_labels=honor_labels,
        job_name=service,
        binary=binary,
    ) as prom:
        yield prom


# -- the dashboard's queries ------------------------------------------------------------


@dataclass(frozen=True)
class DashboardAnswers:
    """What each query of a dashboard returned: panel targets by ``title [refId]`` (their
    vectors), template variables by name (their values)."""

    panels: dict[str, list[Sample]]
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
    if "$" in expr.replace("$__", ""):
        raise PrometheusError(f"a variable left in {expr!r}")
    return expr


def target_key(panel: Mapping[str, Any], target: Mapping[str, Any]) -> str:
    """How the answers name a panel's query: ``title [refId]``."""
    return f"{panel['title']} [{target['refId']}]"


def panel_queries(
    dashboard: dict[str, Any], variables: dict[str, str], rate_interval: str
) -> list[tuple[str, str]]:
    """Each panel target's :func:`target_key` and its query with the variables set."""
    return [
        (target_key(panel, target), substitute(target["expr"], variables, rate_interval))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def query_dashboard(
    prom: Prometheus,
    dashboard: dict[str, Any],
    variables: dict[str, str],
    rate_interval: str = "1m",
) -> DashboardAnswers:
    """Every query of ``dashboard`` as Grafana sends it with each variable set to one
    value: panel targets as instant queries, ``label_values(selector, label)`` variables
    as the label-values API."""
    panels = {
        key: prom.query(expr) for key, expr in panel_queries(dashboard, variables, rate_interval)
    }
    answers: dict[str, list[str]] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"].strip())
        if not found:
            raise PrometheusError(
                f"variable {var['name']}: not label_values(...): {var['query']!r}"
            )
        selector = substitute(found.group(1), variables, rate_interval)
        label = found.group(2)
        answers[var["name"]] = list(prom.api(f"label/{label}/values", **{"match[]": selector}))
    return DashboardAnswers(panels, answers)


def query_dashboard_range(
    prom: Prometheus,
    dashboard: dict[str, Any],
    variables: dict[str, str],
    start: float,
    end: float,
    step: float,
    rate_interval: str = "1m",
) -> dict[str, list[RangeSeries]]:
    """Every panel query of ``dashboard`` over ``start``..``end`` (unix times), a point
    each ``step`` seconds, as a time-series panel asks: by :func:`target_key`."""
    return {
        key: prom.query_range(expr, start, end, step)
        for key, expr in panel_queries(dashboard, variables, rate_interval)
    }
