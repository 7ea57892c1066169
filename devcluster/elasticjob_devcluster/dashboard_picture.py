"""The chart's Grafana dashboard drawn without Grafana: each panel's queries as a real
Prometheus answered them over a time range (``prometheus.query_dashboard_range``), laid
out on the dashboard's own grid in one PNG. ``make demo`` draws its job's
(``demo-dashboard.png``, docs/goodput.md).

:func:`picture` is pure: what to draw per panel, from the dashboard's JSON and the range
answers; it refuses a panel it cannot draw (a type or unit it does not know, a query with
no answer), so a panel added to the dashboard is drawn or the unit tests say why not.
:func:`draw` needs matplotlib (Agg), imported where it is used. Here, not in the
operator: it is a picture of Prometheus's answers, not of a job's status (that is the
operator's ``timeline.py``), for the demo and the tests, and the Prometheus it reads is
started by this package.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from elasticjob_devcluster.prometheus import RangeSeries, target_key

HEADER: Final = (
    "{job}: the chart's Grafana dashboard ({source}), each query as the real Prometheus "
    "answered it; drawn with matplotlib, not Grafana"
)
KINDS: Final = frozenset({"stat", "timeseries"})  # Grafana panel types drawn
# Grafana's unit ids drawn, and the y axis's label for each ("": none; percentunit's
# ticks say % themselves)
UNITS: Final[dict[str, str]] = {"percentunit": "", "s": "seconds", "short": "", "none": ""}
# Not a series' own: the job selected (the header names it) and the labels a scrape adds
HIDDEN_LABELS: Final = frozenset(
    {"__name__", "namespace", "job", "instance", "service", "endpoint", "pod", "container"}
)
GRID_COLUMNS: Final = 24  # Grafana's gridPos width
DEFAULT_GRID: Final = {"w": 12, "h": 8}


class DashboardPictureError(Exception):
    """Why the dashboard was not drawn."""


@dataclass(frozen=True)
class Line:
    """One series: its legend and its points (seconds since the picture's origin, value;
    NaN where Prometheus had none)."""

    label: str
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # "stat" (its last values written large) or "timeseries"
    unit: str  # Grafana's unit id
    stacked: bool  # the series' values stacked (then every line has the same times)
    y_min: float | None
    y_max: float | None
    grid: tuple[int, int, int, int]  # x, y, w, h on Grafana's 24-column grid
    lines: tuple[Line, ...]


@dataclass(frozen=True)
class Picture:
    title: str
    x_label: str
    panels: tuple[Panel, ...]


def picture(
    dashboard: Mapping[str, Any],
    answers: Mapping[str, Sequence[RangeSeries]],
    *,
    job: str,
    origin: float,
    origin_name: str = "",
    source: str = "dashboards/goodput.json",
) -> Picture:
    """What to draw of ``dashboard`` from ``answers`` (range answers by
    ``title [refId]``); x is seconds since ``origin`` (a unix time, named in the x
    axis's label as ``origin_name``, else as its UTC time)."""
    panels = []
    bottom = 0
    for raw in dashboard["panels"]:
        panel = _panel(raw, answers, origin, bottom)
        bottom = max(bottom, panel.grid[1] + panel.grid[3])
        panels.append(panel)
    if not panels:
        raise DashboardPictureError("the dashboard has no panels")
    since = origin_name or f"{datetime.fromtimestamp(origin, UTC):%H:%M:%S} UTC"
    return Picture(HEADER.format(job=job, source=source), f"seconds since {since}", tuple(panels))


def _panel(
    raw: Mapping[str, Any], answers: Mapping[str, Sequence[RangeSeries]], origin: float, bottom: int
) -> Panel:
    title = str(raw.get("title", ""))
    kind = raw.get("type")
    if kind not in KINDS:
        raise DashboardPictureError(
            f"panel {title!r}: type {kind!r} is not drawn (only {sorted(KINDS)})"
        )
    defaults = raw.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "none")
    if unit not in UNITS:
        raise DashboardPictureError(
            f"panel {title!r}: unit {unit!r} is not drawn (only {sorted(UNITS)})"
        )
    stacking = defaults.get("custom", {}).get("stacking", {}).get("mode", "none")
    targets = raw.get("targets", [])
    if not targets:
        raise DashboardPictureError(f"panel {title!r} has no queries")
    lines: list[Line] = []
    for target in targets:
        key = target_key(raw, target)
        if key not in answers:
            raise DashboardPictureError(f"no answer for {key}")
        for labels, points in answers[key]:
            label = legend(labels, target.get("legendFormat", ""), target["refId"])
            if any(line.label == label for line in lines):
                label = f"{label} [{target['refId']}]"
            lines.append(Line(label, tuple((t - origin, v) for t, v in points)))
    stacked = stacking != "none"
    if stacked:
        lines = aligned(lines)
    pos = {**DEFAULT_GRID, "x": 0, "y": bottom, **raw.get("gridPos", {})}
    return Panel(
        title=title,
        kind=str(kind),
        unit=unit,
        stacked=stacked,
        y_min=_number(defaults.get("min")),
        y_max=_number(defaults.get("max")),
        grid=(int(pos["x"]), int(pos["y"]), int(pos["w"]), int(pos["h"])),
        lines=tuple(lines),
    )


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def legend(labels: Mapping[str, str], legend_format: str, ref_id: str) -> str:
    """A series' legend: its labels less the selected job's and the scrape's
    (``cause=failure``); with none left (a sum, a quantile), the target's
    ``legendFormat`` as Grafana fills it in (``p95``, ``demo/demo``), else its refId."""
    own = sorted((k, v) for k, v in labels.items() if k not in HIDDEN_LABELS)
    if own:
        return ", ".join(f"{k}={v}" for k, v in own)
    filled = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), legend_format)
    return filled.strip() or ref_id


def aligned(lines: Sequence[Line]) -> list[Line]:
    """``lines`` on the union of their times, to stack: a series absent at a time counts
    0 there (these are counters; one not yet created is at 0), NaN too."""
    times = sorted({t for line in lines for t, _ in line.points})
    out = []
    for line in lines:
        values = {t: v for t, v in line.points if not math.isnan(v)}
        out.append(Line(line.label, tuple((t, values.get(t, 0.0)) for t in times)))
    return out


def format_value(value: float, unit: str) -> str:
    """A stat panel's value as Grafana writes it for ``unit``."""
    if math.isnan(value):
        return "no value"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value:.1f} s"
    return f"{value:.4g}"


def last_value(line: Line) -> float:
    """A series' newest value that is a number (NaN: none)."""
    return next((v for _, v in reversed(line.points) if not math.isnan(v)), math.nan)


def draw(pic: Picture, path: Path) -> Path:
    """``pic`` as a PNG at ``path``; its path. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise DashboardPictureError("drawing the dashboard needs matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    rows = max(p.grid[1] + p.grid[3] for p in pic.panels)
    fig = plt.figure(figsize=(18, 0.5 * rows + 1.0), dpi=100, layout="constrained")
    try:
        grid = fig.add_gridspec(rows, GRID_COLUMNS)
        for panel in pic.panels:
            x, y, w, h = panel.grid
            ax = fig.add_subplot(grid[y : y + h, x : min(x + w, GRID_COLUMNS)])
            _draw_panel(ax, panel, pic.x_label)
            if panel.unit == "percentunit":
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        fig.suptitle(pic.title, fontsize=11)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def _draw_panel(ax: Any, panel: Panel, x_label: str) -> None:
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    ax.set_xlabel(x_label, fontsize=8)
    ax.tick_params(labelsize=8)
    if UNITS[panel.unit]:
        ax.set_ylabel(UNITS[panel.unit], fontsize=8)
    drawn = [line for line in panel.lines if line.points]
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif panel.stacked:
        times = [t for t, _ in drawn[0].points]
        ax.stackplot(
            times,
            *[[v for _, v in line.points] for line in drawn],
            labels=[line.label for line in drawn],
            alpha=0.8,
        )
    else:
        for line in drawn:
            ax.plot([t for t, _ in line.points], [v for _, v in line.points], label=line.label)
    if drawn and panel.kind == "stat":
        low, high = ax.get_ylim()  # room above the lines for the values, written large
        ax.set_ylim(low, high + (high - low) * (0.2 + 0.15 * len(drawn)))
        text = "\n".join(
            f"{line.label}: {format_value(last_value(line), panel.unit)}" for line in drawn
        )
        ax.text(
            0.02,
            0.95,
            text,
            transform=ax.transAxes,
            va="top",
            fontsize=12 if len(drawn) == 1 else 9,
            fontweight="bold",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
        )
    elif drawn:
        ax.legend(fontsize=7, loc="upper left", frameon=False)
    if panel.y_min is not None or panel.y_max is not None:
        ax.set_ylim(panel.y_min, panel.y_max)
