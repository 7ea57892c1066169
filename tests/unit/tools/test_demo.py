"""The demo's summary figures, computed from worker log lines (scripts/demo.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DEMO = Path(__file__).resolve().parents[3] / "scripts" / "demo.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elasticjob_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["elasticjob_demo"] = module
    spec.loader.exec_module(module)
    return module


LOG = [
    "starting fresh world=2 rank=0 restarts=0 startup=3.1s t=100.0",
    "step=50 epoch=0 loss=0.5000 world=2 rank=0 restarts=0 samples=3200 pid=1 t=105.0",
    "step=60 epoch=0 loss=0.4000 world=2 rank=0 restarts=0 samples=3840 pid=1 t=106.0",
    # the fault lands at t=106.5; the old round still logs one step while it winds down
    "step=70 epoch=0 loss=0.3900 world=2 rank=0 restarts=0 samples=4480 pid=1 t=107.0",
    "resumed from step 50 (/checkpoints/step-50.pt) world=1 rank=0 restarts=1 t=112.0",
    "step=60 epoch=0 loss=0.4100 world=1 rank=0 restarts=1 samples=3840 pid=2 t=113.0",
    "step=70 epoch=0 loss=0.3800 world=1 rank=0 restarts=1 samples=4160 pid=2 t=114.0",
    "step=80 epoch=0 loss=0.3700 world=1 rank=0 restarts=1 samples=4480 pid=2 t=115.0",
]


def test_pause_runs_from_the_old_rounds_last_step_to_the_new_rounds_first_step_past_it(
    demo: ModuleType,
) -> None:
    r = demo.recovery(LOG, injected_at=106.5, at_step=70)
    assert r is not None
    assert r.paused_for == pytest.approx(115.0 - 107.0)
    assert (r.resumed_from, r.world) == (50, 1)


def test_no_recovery_until_a_new_round_has_passed_the_faults_step(demo: ModuleType) -> None:
    assert demo.recovery(LOG[:5], injected_at=106.5, at_step=70) is None
    assert demo.recovery(LOG[:4], injected_at=106.5, at_step=70) is None


def test_result_line_is_parsed_and_other_lines_are_not(demo: ModuleType) -> None:
    assert demo.parse_result('ELASTICJOB_RESULT {"final_loss": 0.1}') == {"final_loss": 0.1}
    assert demo.parse_result("step=1 loss=2") is None


def test_a_lost_pod_reports_both_pauses_until_the_world_is_whole_again(
    demo: ModuleType,
) -> None:
    rejoined = [
        *LOG,
        "step=90 epoch=0 loss=0.3600 world=1 rank=0 restarts=1 samples=4800 pid=2 t=116.0",
        # the replacement pod joins: the group restarts at world size 2
        "resumed from step 90 (/dev/shm/x) world=2 rank=0 restarts=1 t=117.5",
        "step=91 epoch=0 loss=0.3500 world=2 rank=0 restarts=1 samples=4864 pid=3 t=117.6",
    ]
    assert demo.recoveries(LOG, 106.5, 70, world=2) is None  # still at world size 1
    first, second = demo.recoveries(rejoined, 106.5, 70, world=2)
    assert (first.world, second.world) == (1, 2)
    assert second.paused_for == pytest.approx(117.6 - 116.0)
    assert demo.describe([first, second]).endswith("; then 1.6s -> world size 2")
    assert demo.recoveries(rejoined, 106.5, 70, world=1) == [first]


class FakeDemo:
    """A demo whose job is ``job`` (only draw_timeline's one call)."""

    def __init__(self, job: dict[str, object]) -> None:
        self.reads = 0
        self._job = job

    def job(self) -> dict[str, object]:
        self.reads += 1
        return self._job


GOODPUT = {
    "runId": "uid-1",
    "ratio": 0.9,
    "percent": "90.0%",
    "wallSeconds": 100.0,
    "trainingSeconds": 90.0,
    "waitingSeconds": 4.0,
    "startupSeconds": 5.0,
    "pausedSeconds": {"failure": 1.0},
    "lostSeconds": 0.0,
    "checkpointSeconds": 0.0,
    "recoveries": {"failure": 1},
    "longestPauseSeconds": 1.0,
    "step": 700,
    "throughTime": "2026-11-28T09:01:40Z",
    "timeline": [
        {"cause": "start", "since": "2026-11-28T09:00:04Z", "time": "2026-11-28T09:00:09Z",
         "pauseSeconds": 5.0, "fromStep": 0, "step": 1, "world": 2},
        {"cause": "failure", "since": "2026-11-28T09:00:30Z", "time": "2026-11-28T09:00:31Z",
         "pauseSeconds": 1.0, "fromStep": 200, "step": 201, "world": 2},
    ],
}  # fmt: skip


def test_the_demo_ends_with_a_picture_of_its_job(demo: ModuleType, tmp_path: Path) -> None:
    job = {"metadata": {"name": "demo", "namespace": "demo"}, "status": {"goodput": GOODPUT}}
    path = demo.draw_timeline(FakeDemo(job), tmp_path / "demo-timeline.png")
    assert path == (tmp_path / "demo-timeline.png").resolve()
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_demo_job_without_goodput_is_not_drawn(demo: ModuleType, tmp_path: Path) -> None:
    fake = FakeDemo({"metadata": {"name": "demo", "namespace": "demo"}, "status": {}})
    with pytest.raises(demo.timeline.TimelineError, match=r"no status\.goodput yet"):
        demo.draw_timeline(fake, tmp_path / "demo-timeline.png", timeout=-1)
    assert fake.reads == 1
    assert not (tmp_path / "demo-timeline.png").exists()


def test_the_summary_says_the_goodput_and_where_the_rest_went(demo: ModuleType) -> None:
    line = demo.goodput_line(GOODPUT)
    assert line.startswith(f"goodput:          {GOODPUT['percent']} of ")
    assert "paused failure 1.0s" in line and "startup 5.0s" in line


class FakePrometheus:
    """Answers every range query with one series per query (the demo's job's)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float, float, float]] = []

    def query_range(
        self, expr: str, start: float, end: float, step: float
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        self.asked.append((expr, start, end, step))
        labels = {"namespace": "demo", "job": "demo", "cause": "failure", "bucket": "training"}
        return [(labels, [(start, 0.5), (start + step, 0.6)])]


def test_the_demo_draws_the_dashboard_its_prometheus_answered(
    demo: ModuleType, tmp_path: Path
) -> None:
    fake = FakePrometheus()
    scrape = demo.Scrape(prom=fake, since=time.time() - 120)
    fake_demo = types.SimpleNamespace(started=time.monotonic() - 125)
    path = demo.draw_dashboard(fake_demo, scrape, tmp_path / "demo-dashboard.png")
    assert path == (tmp_path / "demo-dashboard.png").resolve()
    assert path.read_bytes()[:4] == b"\x89PNG"
    dashboard = json.loads(demo.DASHBOARD.read_text())
    assert len(fake.asked) == sum(len(p["targets"]) for p in dashboard["panels"])
    for expr, start, end, step in fake.asked:
        assert 'namespace=~"demo"' in expr and 'job=~"demo"' in expr
        assert start == scrape.since and end - start == pytest.approx(120, abs=5)
        assert step == 1.0  # a point a second over the demo's few minutes


def test_a_demo_whose_prometheus_did_not_start_says_so_at_the_end(
    demo: ModuleType, tmp_path: Path
) -> None:
    scrape = demo.Scrape(error="Prometheus did not start: no route")
    fake_demo = types.SimpleNamespace(started=time.monotonic())
    with pytest.raises(demo.dashboard_picture.DashboardPictureError, match="no route"):
        demo.draw_dashboard(fake_demo, scrape, tmp_path / "demo-dashboard.png")
    assert not (tmp_path / "demo-dashboard.png").exists()


def test_without_the_prometheus_binary_the_demo_exits_1_before_starting_anything(
    demo: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    def missing() -> str:
        raise demo.prometheus.PrometheusMissing("no prometheus binary on PATH")

    monkeypatch.setattr(demo.prometheus, "find_binary", missing)
    monkeypatch.setattr(demo, "DevCluster", None)  # it would fail if the demo got that far
    assert demo.main(["--dir", str(tmp_path / "cluster")]) == 1
    assert "no prometheus binary on PATH" in capsys.readouterr().err
    assert not (tmp_path / "cluster").exists()
