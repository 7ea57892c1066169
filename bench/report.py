"""One shape for every benchmark figure: ours beside its baseline from the same run, the
median of several repetitions, the target it is held to, and whether it met it.

Every scenario module (``bench/rdzv_scale.py``, ``bench/checkpoint_stall.py``,
``bench/operator_load.py``, ...) returns :class:`Figure` rows; ``bench.run`` writes them
all to one JSON file and one markdown table, so the README's numbers come from a file,
not from memory.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Figure:
    scenario: str  # the ``--scenarios`` name that measured it, e.g. "checkpoint-stall"
    case: str  # what varies within the scenario, e.g. "N=1024" or "1 GB"
    metric: str  # what was measured, e.g. "round formed (first join -> all hold it)"
    unit: str  # "s", "MiB", "requests/agent", "%"
    ours: list[float] = field(default_factory=list)  # one sample per repetition
    baseline: list[float] = field(default_factory=list)  # same, for the baseline
    baseline_name: str | None = None  # e.g. "torch DynamicRendezvousHandler (c10d)"
    target: str | None = None  # human-readable, e.g. "<= 5 s"
    met: bool | None = None  # None: no target, or nothing measured
    failures: list[str] = field(default_factory=list)  # repetitions that did not finish
    note: str = ""

    @property
    def ours_median(self) -> float | None:
        return median(self.ours)

    @property
    def baseline_median(self) -> float | None:
        return median(self.baseline)

    @property
    def ratio(self) -> float | None:
        """ours / baseline (medians), where both exist."""
        o, b = self.ours_median, self.baseline_median
        return None if o is None or b is None or b == 0 else o / b

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ours_median": self.ours_median,
            "baseline_median": self.baseline_median,
            "ratio": self.ratio,
        }


def median(samples: Sequence[float]) -> float | None:
    return statistics.median(samples) if samples else None


def middle_and_range(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> str:
    """``key middle (min-max), ...`` over ``rows`` (the middle one when sorted: the upper
    of the two middles for an even count), for a measurement's printed summary."""
    parts = []
    for key in keys:
        values = sorted(float(row[key]) for row in rows)
        middle, low, high = values[len(values) // 2], values[0], values[-1]
        parts.append(f"{key} {middle:.3g} ({low:.3g}-{high:.3g})")
    return ", ".join(parts)


def _value(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "%":
        return f"{x:.1f} %"
    if abs(x) >= 100:
        return f"{x:.0f} {unit}"
    if abs(x) >= 10:
        return f"{x:.1f} {unit}"
    return f"{x:.2f} {unit}"


def _cell(samples: Sequence[float], unit: str, failures: int = 0) -> str:
    if not samples:
        return f"failed ({failures})" if failures else "-"
    text = _value(median(samples), unit)
    if len(samples) > 1:
        text += f" (n={len(samples)})"
    if failures:
        text += f", {failures} failed"
    return text


def markdown_table(figures: Sequence[Figure]) -> str:
    """One row per figure: ours, the baseline, ours/baseline, the target, met or not."""
    rows = [["scenario", "case", "metric", "ours", "baseline", "ours/baseline", "target", "met"]]
    for f in figures:
        ratio = f.ratio
        rows.append(
            [
                f.scenario,
                f.case,
                f.metric,
                _cell(f.ours, f.unit, len(f.failures)),
                _cell(f.baseline, f.unit) + (f" ({f.baseline_name})" if f.baseline_name else ""),
                "-" if ratio is None else f"{ratio:.2f}",
                f.target or "-",
                {True: "yes", False: "**no**", None: "-"}[f.met],
            ]
        )
    return render(rows)


def render(rows: Sequence[Sequence[str]]) -> str:
    """Rows (the first is the header) as a markdown table, columns padded to line up."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write(figures: Sequence[Figure], path: Path, extra: dict[str, Any] | None = None) -> Path:
    """``path`` (.json) with every figure and ``extra``; the table beside it as .md."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**(extra or {}), "figures": [f.to_json() for f in figures]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown_table(figures) + "\n")
    return path


def write_probe(path: Path, args: Any, body: dict[str, Any]) -> None:
    """A probe's results (``python -m bench.<probe> --out``): when, with what arguments
    (``--out`` itself left out), and ``body``."""
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M"), "args": vars(args) | {"out": None}}
    path.write_text(json.dumps(doc | body, indent=2) + "\n")
