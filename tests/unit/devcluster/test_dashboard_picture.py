"""The chart's dashboard drawn from Prometheus's range answers (elasticjob_devcluster/
dashboard_picture.py): every panel of the real goodput.json is drawn, its series
labelled by their own labels, and the PNG is written."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from elasticjob_devcluster import dashboard_picture
from elasticjob_devcluster.dashboard_picture import DashboardPictureError, Panel, picture

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = json.loads(
    (REPO / "charts" / "elasticjob-operator" / "dashboards" / "goodput.json").read_text()
)
T0 = 1_800_000_000.0
JOB = {"namespace": "demo", "job": "demo"}
# what the scrape adds (honor_labels keeps the series' namespace and job)
SCRAPE = {"instance": "127.0.0.1:40000", "service": "elasticjob-operator-metrics"}
NAN = float("nan")


def points(*values: float, start: float = 0.0) -> list[tuple[float, float]]:
    return [(T0 + start + i, v) for i, v in enumerate(values)]


# A range answer for every panel query of the real dashboard, as the demo's Prometheus
# gives them: a panel added to the dashboard needs its answer here (the first test).
ANSWERS: dict[str, list[tuple[dict[str, str], list[tuple[float, float]]]]] = {
    "Goodput [A]": [
        ({"__name__": "elasticjob_job_goodput_ratio", **JOB, **SCRAPE}, points(0.5, 0.8, 0.9))
    ],
    "Recoveries [A]": [
        ({"cause": "failure"}, points(0, 1, 1)),
        ({"cause": "join"}, points(1, 1, 2)),
    ],
    "Samples per second [A]": [({}, points(500, 580, 590))],
    "Where the time went (seconds, by bucket) [A]": [
        ({"bucket": "training"}, points(1, 2, 3)),
        ({"bucket": "paused"}, points(0.5, 0.5, start=1)),  # created a second later
    ],
    "Pauses by cause (seconds) [A]": [({"cause": "failure"}, points(0.4, 0.5, NAN))],
    "Recovery pause (p50, p95 of the recoveries so far) [A]": [({}, points(NAN, 0.5, 0.5))],
    "Recovery pause (p50, p95 of the recoveries so far) [B]": [({}, points(NAN, 0.9, 0.9))],
    "Goodput over time [A]": [({**JOB, **SCRAPE}, points(0.5, 0.8, 0.9))],
}


def draw_all() -> dict[str, Panel]:
    pic = picture(DASHBOARD, ANSWERS, job="demo/demo", origin=T0, origin_name="the demo's start")
    return {p.title: p for p in pic.panels}


def test_every_panel_of_the_dashboard_is_drawn_from_its_answers() -> None:
    keys = {f"{p['title']} [{t['refId']}]" for p in DASHBOARD["panels"] for t in p["targets"]}
    assert keys == set(ANSWERS), "a panel of goodput.json without its answer here"
    panels = draw_all()
    assert list(panels) == [p["title"] for p in DASHBOARD["panels"]]
    for raw in DASHBOARD["panels"]:
        panel = panels[raw["title"]]
        g = raw["gridPos"]
        assert panel.grid == (g["x"], g["y"], g["w"], g["h"])
        assert panel.kind == raw["type"] and panel.lines
    labels = {title: [line.label for line in p.lines] for title, p in panels.items()}
    assert labels == {
        "Goodput": ["demo/demo"],  # its legendFormat: no label of its own is left
        "Recoveries": ["cause=failure", "cause=join"],
        "Samples per second": ["samples/s"],
        "Where the time went (seconds, by bucket)": ["bucket=training", "bucket=paused"],
        "Pauses by cause (seconds)": ["cause=failure"],
        "Recovery pause (p50, p95 of the recoveries so far)": ["p50", "p95"],
        "Goodput over time": ["demo/demo"],
    }


def test_units_ranges_and_stacking_are_the_panels_own() -> None:
    panels = draw_all()
    goodput = panels["Goodput"]
    assert (goodput.unit, goodput.y_min, goodput.y_max) == ("percentunit", 0.0, 1.0)
    assert panels["Pauses by cause (seconds)"].unit == "s"
    time_went = panels["Where the time went (seconds, by bucket)"]
    assert time_went.stacked and not panels["Goodput over time"].stacked
    # stacked: on one set of times, a series not there yet counting 0
    training, paused = time_went.lines
    assert [t for t, _ in training.points] == [t for t, _ in paused.points] == [0.0, 1.0, 2.0]
    assert [v for _, v in paused.points] == [0.0, 0.5, 0.5]
    p50 = panels["Recovery pause (p50, p95 of the recoveries so far)"].lines[0]
    assert math.isnan(p50.points[0][1]) and p50.points[1] == (1.0, 0.5)


def test_the_header_says_what_it_is_and_what_drew_it() -> None:
    pic = picture(DASHBOARD, ANSWERS, job="demo/demo", origin=T0, origin_name="the demo's start")
    assert pic.title == (
        "demo/demo: the chart's Grafana dashboard (dashboards/goodput.json), each query as "
        "the real Prometheus answered it; drawn with matplotlib, not Grafana"
    )
    assert pic.x_label == "seconds since the demo's start"


def test_a_panel_that_cannot_be_drawn_is_refused_saying_why() -> None:
    def with_panel(**change: Any) -> dict[str, Any]:
        panels = [dict(DASHBOARD["panels"][0], **change)]
        return {**DASHBOARD, "panels": panels}

    with pytest.raises(DashboardPictureError, match=r"type 'table' is not drawn"):
        picture(with_panel(type="table"), ANSWERS, job="j", origin=T0)
    unit = {"defaults": {"unit": "bytes"}}
    with pytest.raises(DashboardPictureError, match=r"unit 'bytes' is not drawn"):
        picture(with_panel(fieldConfig=unit), ANSWERS, job="j", origin=T0)
    with pytest.raises(DashboardPictureError, match=r"no answer for New \[A\]"):
        picture(with_panel(title="New"), ANSWERS, job="j", origin=T0)


def test_stat_values_are_written_in_their_unit() -> None:
    assert dashboard_picture.format_value(0.9031, "percentunit") == "90.3%"
    assert dashboard_picture.format_value(1.25, "s") == "1.2 s"
    assert dashboard_picture.format_value(587.4, "short") == "587.4"
    assert dashboard_picture.format_value(NAN, "s") == "no value"
    line = dashboard_picture.Line("x", ((0.0, 1.0), (1.0, NAN)))
    assert dashboard_picture.last_value(line) == 1.0


def test_the_picture_is_a_png(tmp_path: Path) -> None:
    pic = picture(DASHBOARD, ANSWERS, job="demo/demo", origin=T0)
    empty = {key: [] for key in ANSWERS}  # "no data" panels draw too
    path = dashboard_picture.draw(pic, tmp_path / "out" / "dashboard.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    nothing = dashboard_picture.draw(
        picture(DASHBOARD, empty, job="demo/demo", origin=T0), tmp_path / "empty.png"
    )
    assert nothing.read_bytes()[:4] == b"\x89PNG"
