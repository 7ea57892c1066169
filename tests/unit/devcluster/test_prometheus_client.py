"""The Prometheus client the e2e tests and the demo share (elasticjob_devcluster/
prometheus.py), against a fake HTTP API on loopback: Grafana's variables substituted,
every dashboard query sent, instant and range answers read, refusals raised; finding
the binary; stopping a process by its pid."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from elasticjob_devcluster import prometheus
from elasticjob_devcluster.prometheus import (
    Prometheus,
    PrometheusError,
    query_dashboard,
    query_dashboard_range,
    substitute,
)

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "charts" / "elasticjob-operator" / "dashboards" / "goodput.json"


# -- substitute ----------------------------------------------------------------------------


def test_variables_take_their_one_value_in_both_spellings() -> None:
    expr = 'x{namespace=~"$namespace", job=~"${job}"}[$__rate_interval]'
    got = substitute(expr, {"namespace": "ml", "job": "bert"}, "2m")
    assert got == 'x{namespace=~"ml", job=~"bert"}[2m]'
    assert substitute("rate(x[${__rate_interval}])", {}, "4s") == "rate(x[4s])"


def test_a_value_is_a_regex_literal_in_promql_as_grafana_puts_it() -> None:
    got = substitute('x{job=~"$job"}', {"job": "a.b-1"}, "1m")
    assert got == 'x{job=~"a\\\\.b-1"}'  # PromQL's string \\. is the regex \.


def test_a_variable_is_not_a_prefix_of_a_longer_name() -> None:
    got = substitute('x{a="$job", b="$jobs"}', {"job": "j", "jobs": "J"}, "1m")
    assert got == 'x{a="j", b="J"}'


def test_a_variable_without_a_value_is_refused() -> None:
    with pytest.raises(PrometheusError, match=r"a variable left in"):
        substitute('x{job=~"$job"}', {"namespace": "ml"}, "1m")


# -- the HTTP API ----------------------------------------------------------------------------


class FakeAPI(BaseHTTPRequestHandler):
    """Answers /api/v1/{query,query_range,label/*/values}: every request recorded;
    ``refuse`` in a query answers 400 as Prometheus does."""

    requests: list[tuple[str, dict[str, str]]]

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(url.query))
        self.requests.append((url.path, params))
        status, body = 200, self.answer(url.path, params)
        if "refuse" in params.get("query", ""):
            status, body = 400, {"status": "error", "errorType": "bad_data", "error": "parse"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def answer(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        metric = {"namespace": "ml", "job": "bert", "cause": "failure"}
        if path == "/api/v1/query":
            vector = [{"metric": metric, "value": [100.0, "0.5"]}]
            return {"status": "success", "data": {"resultType": "vector", "result": vector}}
        if path == "/api/v1/query_range":
            values = [[100.0, "1"], [101.0, "NaN"], [102.0, "+Inf"]]
            result = [{"metric": metric, "values": values}]
            return {"status": "success", "data": {"resultType": "matrix", "result": result}}
        if path.startswith("/api/v1/label/"):
            return {"status": "success", "data": [path.split("/")[4]]}
        return {"status": "error", "error": f"no {path}"}

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[tuple[Prometheus, list[tuple[str, dict[str, str]]]]]:
    requests: list[tuple[str, dict[str, str]]] = []
    handler = type("Handler", (FakeAPI,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])  # a process, never used
    proc.wait()
    try:
        yield (
            Prometheus(f"http://127.0.0.1:{server.server_port}", Path("/dev/null"), proc),
            requests,
        )
    finally:
        server.shutdown()
        server.server_close()


def test_every_panel_query_and_variable_of_the_dashboard_is_asked(api: Any) -> None:
    prom, requests = api
    dashboard = json.loads(DASHBOARD.read_text())
    answers = query_dashboard(prom, dashboard, {"namespace": "ml", "job": "bert"})
    keys = {
        f"{p['title']} [{t['refId']}]" for p in dashboard["panels"] for t in p.get("targets", [])
    }
    assert set(answers.panels) == keys
    assert all(v == [({"namespace": "ml", "job": "bert", "cause": "failure"}, 0.5)]
               for v in answers.panels.values())  # fmt: skip
    queries = [p["query"] for path, p in requests if path == "/api/v1/query"]
    assert len(queries) == len(keys) and all("$" not in q for q in queries)
    assert all('namespace=~"ml"' in q and 'job=~"bert"' in q for q in queries)
    labels = {path: p["match[]"] for path, p in requests if path.startswith("/api/v1/label/")}
    assert labels == {
        "/api/v1/label/namespace/values": "elasticjob_job_goodput_ratio",
        "/api/v1/label/job/values": 'elasticjob_job_goodput_ratio{namespace=~"ml"}',
    }
    assert answers.variables == {"namespace": ["namespace"], "job": ["job"]}


def test_range_queries_ask_start_end_and_step_and_read_every_point(api: Any) -> None:
    prom, requests = api
    dashboard = json.loads(DASHBOARD.read_text())
    got = query_dashboard_range(prom, dashboard, {"namespace": "ml", "job": "bert"}, 100, 102, 1)
    ((labels, points),) = got["Goodput over time [A]"]
    assert labels["cause"] == "failure"
    assert points[0] == (100.0, 1.0) and points[2] == (102.0, float("inf"))
    assert points[1][1] != points[1][1]  # NaN
    asked = [p for path, p in requests if path == "/api/v1/query_range"]
    assert len(asked) == len(got)
    assert {(p["start"], p["end"], p["step"]) for p in asked} == {("100", "102", "1")}


def test_a_refused_query_raises_with_prometheus_reason(api: Any) -> None:
    prom, _ = api
    with pytest.raises(PrometheusError, match=r"Prometheus refused query .*bad_data"):
        prom.query("refuse(")
    with pytest.raises(PrometheusError, match=r"not a matrix"):
        prometheus.matrix("x", {"resultType": "vector", "result": []})


# -- the binary and the process ------------------------------------------------------------


def test_the_binary_comes_from_path_or_the_bootstrap_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setenv("ELASTICJOB_CACHE", str(tmp_path))
    with pytest.raises(prometheus.PrometheusMissing, match=r"scripts/bootstrap\.sh"):
        prometheus.find_binary()
    cached = tmp_path / "tools" / "prometheus"
    cached.parent.mkdir()
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    assert prometheus.find_binary() == str(cached)


def test_a_tsdb_left_from_another_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with (
        pytest.raises(PrometheusError, match=r"not a fresh TSDB"),
        prometheus.running_prometheus(
            "127.0.0.1:1", tmp_path, target_labels={}, honor_labels=True, binary="/bin/false"
        ),
    ):
        pass


def test_a_stopped_process_is_reaped_and_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    prometheus.stop_process(proc, "sleeper")
    assert proc.returncode is not None
