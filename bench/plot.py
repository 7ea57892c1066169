"""The goodput run as a picture: training step against time for each launcher, faults
marked, so the pauses are seen rather than read (matplotlib, written as PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.goodput import Goodput


def plot_goodput(
    runs: Sequence[Goodput],
    path: Path,
    title: str = "Training through a worker SIGKILL every 30 s (same script, same faults)",
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    for run in runs:
        if not run.timeline:
            continue
        xs, ys = zip(*run.timeline, strict=True)
        label = f"{run.launcher}: goodput {run.goodput:.1%}" if run.goodput else run.launcher
        ax.plot(xs, ys, ".", markersize=1.5, label=label)
    faults = runs[0].faults if runs else []
    for i, t in enumerate(faults):
        ax.axvline(
            t,
            color="grey",
            linestyle="--",
            linewidth=0.6,
            label="SIGKILL a worker" if i == 0 else None,
        )
    ax.set_xlabel("seconds since the first fault window began")
    ax.set_ylabel("training step")
    ax.set_title(title)
    ax.legend(loc="upper left", markerscale=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
