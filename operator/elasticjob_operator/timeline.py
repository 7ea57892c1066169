"""A picture of a job: its steps and world size against time, each recovery's pause
shaded by its cause, the goodput ledger's totals in the legend (docs/goodput.md, "A
picture of a job"), from the job's ``status.goodput``.

``kubectl elasticjob-timeline JOB`` (the console script ``kubectl-elasticjob_timeline``,
a kubectl plugin) or ``python -m elasticjob_operator.timeline JOB`` reads the job and
writes a PNG.

:func:`series` is pure: the lines and spans to draw. :func:`draw` needs matplotlib and
the command the kubernetes client; both are imported where they are used, so the
operator's image (which has no matplotlib) still imports this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from elasticjob_operator import models
from elasticjob_operator.goodput import SUSPENDED
from elasticjob_runtime.goodput.ledger import START, Cause

INSTALL: Final = "pip install 'elasticjob[timeline]'"
WAITING: Final = "waiting"  # the span from the job's creation to its first run's start
STARTUP: Final = "startup"  # a run's start: its first agent's start to its first step

# A color per span kind (the buckets' and the recoveries' causes); a cause a newer
# runtime adds takes the next of EXTRA_COLORS.
COLORS: Final[dict[str, str]] = {
    WAITING: "#bdbdbd",
    SUSPENDED: "#737373",
    STARTUP: "#9ecae1",
    Cause.FAILURE: "#e6550d",
    Cause.JOIN: "#31a354",
    Cause.DEPARTURE: "#756bb1",
    Cause.RESTART: "#d62728",
}
EXTRA_COLORS: Final = ("#e377c2", "#bcbd22", "#17becf", "#8c564b", "#fdae6b")
STEPS_COLOR: Final = "#1f77b4"
WORLD_COLOR: Final = "#252525"  # not a span color: join is green
TOUCHING: Final = 0.002  # seconds: marks this close are one moment (times are to the ms)

Clock = Callable[[datetime], float]  # a moment as seconds since the job's start


class TimelineError(Exception):
    """Why no picture was drawn, for the user (the command prints it and exits 1)."""


@dataclass(frozen=True)
class Span:
    """A time training did not go on: waiting, a run's startup, a suspension, or a
    recovery (``kind``: its cause), from ``start`` to ``end`` (seconds since the job's
    start); ``seconds``: what the ledger booked for it."""

    kind: str
    start: float
    end: float
    seconds: float


@dataclass(frozen=True)
class Series:
    """What the picture shows; x: seconds since the job's start."""

    title: str
    steps: tuple[tuple[float, int], ...]  # the step line's points, joined by straight lines
    world: tuple[tuple[float, int | None], ...]  # the world size from each x on (None: unknown)
    spans: tuple[Span, ...]
    legend: tuple[tuple[str, str], ...]  # (a span kind or "", its text), in order
    colors: dict[str, str]  # a color for each span kind drawn or named in the legend
    end: float  # the job's wall seconds (its throughTime)


def series(goodput: models.Goodput, job: str) -> Series:
    """The picture of ``job`` (its name, ``namespace/name``) from its ``status.goodput``."""
    start = goodput.through_time.timestamp() - goodput.wall_seconds

    def x(t: datetime) -> float:
        return round(t.timestamp() - start, 3)

    end = round(goodput.wall_seconds, 3)
    marks = goodput.timeline
    spans = _spans(marks, x)
    kinds = [s.kind for s in spans]
    causes = sorted({*goodput.paused_seconds, *goodput.recoveries})
    return Series(
        title=title(goodput, job),
        steps=tuple(_steps(marks, x, end, goodput.step)),
        world=tuple(_world(marks, x)),
        spans=tuple(spans),
        legend=tuple(
            legend(goodput, suspended=sum(s.seconds for s in spans if s.kind == SUSPENDED))
        ),
        colors=colors([WAITING, STARTUP, SUSPENDED, *causes, *kinds]),
        end=end,
    )


def title(goodput: models.Goodput, job: str) -> str:
    runs = f" in {goodput.runs} runs" if goodput.runs > 1 else ""
    return (
        f"ElasticJob {job}: goodput {goodput.percent} of {duration(goodput.wall_seconds)}"
        f"{runs}, step {goodput.step}"
    )


def legend(goodput: models.Goodput, suspended: float = 0.0) -> list[tuple[str, str]]:
    """The ledger's totals, a line per bucket (``kind``: the span color it goes with, ""
    for none), the pauses and recoveries by cause."""
    wall = goodput.wall_seconds

    def share(seconds: float) -> str:
        part = f" ({100 * seconds / wall:.1f}%)" if wall > 0 else ""
        return f"{duration(seconds)}{part}"

    lines = [
        ("", f"training {share(goodput.training_seconds)}"),
        (WAITING, f"waiting {share(goodput.waiting_seconds)}"),
    ]
    if suspended > 0:
        lines.append((SUSPENDED, f"  of it suspended {duration(suspended)}"))
    lines.append((STARTUP, f"startup {share(goodput.startup_seconds)}"))
    for cause in sorted({*goodput.paused_seconds, *goodput.recoveries}):
        count = goodput.recoveries.get(cause, 0)
        seconds = goodput.paused_seconds.get(cause, 0.0)
        times = f"{count} recover{'y' if count == 1 else 'ies'}"
        lines.append((cause, f"paused, {cause}: {share(seconds)}, {times}"))
    lines.append(("", f"lost {share(goodput.lost_seconds)}"))
    lines.append(("", f"checkpoint {share(goodput.checkpoint_seconds)}"))
    if goodput.recoveries:
        lines.append(("", f"longest pause {duration(goodput.longest_pause_seconds)}"))
    return lines


def colors(kinds: Sequence[str]) -> dict[str, str]:
    """A distinct color for each kind: the known ones' own, the others' in order."""
    out: dict[str, str] = {}
    extra = iter(EXTRA_COLORS)
    for kind in kinds:
        if kind not in out:
            out[kind] = COLORS.get(kind) or next(extra, "#7f7f7f")
    return out


def duration(seconds: float) -> str:
    """``12.3 s``, ``14.2 min``, ``3.1 h``."""
    if seconds < 100:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _steps(
    marks: Sequence[models.TimelineMark], x: Clock, end: float, last: int
) -> list[tuple[float, int]]:
    """The step line: flat at the step before each mark (the highest committed) from
    its ``since`` to its ``time``, there at the step after it (lower for a group that
    went back to a checkpoint), straight on to the next mark's ``since``, and to
    (``end``, ``last``). A suspension and the start of the run after it are one pause
    (a start's step before is its run's 0, not the job's)."""
    points: list[tuple[float, int]] = [(0.0, marks[0].from_step if marks else 0)]
    for i, mark in enumerate(marks):
        level = points[-1][1] if mark.cause == START and i > 0 else mark.from_step
        since = max(x(mark.since), points[-1][0])
        at = max(x(mark.time), since)
        points += [(since, level), (at, level)]
        after = marks[i + 1] if i + 1 < len(marks) else None
        starts_next = (
            mark.cause == SUSPENDED
            and after is not None
            and after.cause == START
            and abs(x(after.since) - at) <= TOUCHING
        )
        if not starts_next:  # else the run after it moves the line, at its first step
            points.append((at, mark.step))
    if end > points[-1][0] or points[-1][1] != last:
        points.append((max(end, points[-1][0]), last))
    return _without_repeats(points)


def _world(marks: Sequence[models.TimelineMark], x: Clock) -> list[tuple[float, int | None]]:
    """The group's size from each point on: a mark's from its first step (0 is not
    known: None), none in a suspension (0)."""
    points: list[tuple[float, int | None]] = [(0.0, None)]
    for mark in marks:
        if mark.cause == SUSPENDED:
            points.append((x(mark.since), 0))
        points.append((x(mark.time), mark.world or None))
    return [p for i, p in enumerate(points) if i == 0 or p[1] != points[i - 1][1]]


def _spans(marks: Sequence[models.TimelineMark], x: Clock) -> list[Span]:
    spans: list[Span] = []
    if marks and marks[0].cause == START and x(marks[0].since) > 0:
        first = x(marks[0].since)
        spans.append(Span(WAITING, 0.0, first, first))
    for mark in marks:
        kind = STARTUP if mark.cause == START else mark.cause
        spans.append(Span(kind, x(mark.since), x(mark.time), mark.pause_seconds))
    return spans


def _without_repeats(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The points less each that repeats the one before it."""
    return [p for i, p in enumerate(points) if i == 0 or p != points[i - 1]]


def draw(picture: Series, path: Path) -> Path:
    """``picture`` as a PNG at ``path``; its path. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise TimelineError(f"drawing the timeline needs matplotlib: {INSTALL}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    scale, unit = _unit(picture.end)
    fig, ax = plt.subplots(figsize=(12, 6), dpi=110)
    try:
        top = max((s for _, s in picture.steps), default=0)
        for span in picture.spans:
            color = picture.colors[span.kind]
            ax.axvspan(span.start / scale, span.end / scale, color=color, alpha=0.35, lw=0)
            if span.kind not in (WAITING, STARTUP, SUSPENDED):  # a fault: when it struck
                ax.axvline(span.start / scale, color=color, lw=0.8, ls="--")
                ax.annotate(
                    f"{span.kind} {span.seconds:.1f} s",
                    (span.end / scale, 0.99),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    va="top",
                    ha="left",
                    fontsize=7,
                    color=color,
                )
        xs, ys = zip(*picture.steps, strict=True)
        ax.plot([v / scale for v in xs], ys, color=STEPS_COLOR, lw=1.6)
        ax.set_xlim(0, max(picture.end, xs[-1]) / scale or 1)
        ax.set_ylim(0, max(top, 1) * 1.05)
        ax.set_xlabel(f"{unit} since the job's start")
        ax.set_ylabel("step", color=STEPS_COLOR)
        ax.grid(alpha=0.3)

        sizes = ax.twinx()
        wx = [v / scale for v, _ in picture.world] + [picture.end / scale]
        wy = [float("nan") if w is None else w for _, w in picture.world]
        sizes.step(wx, [*wy, wy[-1]], where="post", color=WORLD_COLOR, lw=1.2)
        known = [w for _, w in picture.world if w is not None]
        sizes.set_ylim(0, max(known, default=1) + 1)
        sizes.yaxis.set_major_locator(MaxNLocator(integer=True))
        sizes.set_ylabel("world size", color=WORLD_COLOR)

        handles: list[Any] = [
            Line2D([], [], color=STEPS_COLOR, lw=1.6, label="step"),
            Line2D([], [], color=WORLD_COLOR, lw=1.2, label="world size"),
        ]
        for kind, text in picture.legend:
            if kind:
                handles.append(Patch(color=picture.colors[kind], alpha=0.35, label=text))
            else:
                handles.append(Line2D([], [], lw=0, label=text))
        ax.legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.07, 1.0), fontsize=8, frameon=False
        )
        ax.set_title(picture.title, fontsize=10)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def _unit(seconds: float) -> tuple[float, str]:
    if seconds > 2 * 3600:
        return 3600.0, "hours"
    if seconds > 600:
        return 60.0, "minutes"
    return 1.0, "seconds"


# -- the command -------------------------------------------------------------------------


def job_goodput(job: dict[str, Any]) -> models.Goodput:
    """The ``status.goodput`` of ``job`` (an ElasticJob as the API returns it)."""
    meta = job.get("metadata") or {}
    name = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
    goodput = (job.get("status") or {}).get("goodput")
    if not goodput:
        raise TimelineError(
            f"elasticjob {name} has no status.goodput yet: the operator writes it once the "
            "job's workers publish their goodput ledger, at their first training step. Wait "
            "for training to start (the GOODPUT column of `kubectl get elasticjobs -o wide`) "
            "and run this again"
        )
    return models.Goodput.model_validate(goodput)


def context_namespace(
    contexts: Sequence[dict[str, Any]], active: str | None, name: str | None
) -> str:
    """The namespace of kubeconfig context ``name`` (None: the current one, ``active``),
    as kubectl takes it: the context's, else ``default``."""
    wanted = name or active
    for context in contexts:
        if context.get("name") == wanted:
            return str((context.get("context") or {}).get("namespace") or "default")
    raise TimelineError(f"no context {wanted!r} in the kubeconfig")


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Draw an ElasticJob's timeline (steps and world size against time, each "
        "recovery's pause, the goodput totals) from its status.goodput, as a PNG.",
    )
    p.add_argument("job", metavar="JOB", help="the ElasticJob's name")
    p.add_argument(
        "-n", "--namespace", help="its namespace (default: the kubeconfig context's namespace)"
    )
    p.add_argument(
        "-o", "--output", type=Path, help="the PNG to write (default: ./JOB-timeline.png)"
    )
    p.add_argument("--kubeconfig", help="the kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", help="the kubeconfig context (default: its current one)")
    return p


def read_job(
    name: str, namespace: str | None, kubeconfig: str | None, context: str | None
) -> dict[str, Any]:
    """The ElasticJob ``name`` from the API server, as kubectl would find it."""
    try:
        from kubernetes import client, config
        from urllib3.exceptions import HTTPError
    except ImportError as exc:
        raise TimelineError(f"reading the job needs the kubernetes client: {INSTALL}") from exc
    try:
        if namespace is None:
            contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
            namespace = context_namespace(contexts, (active or {}).get("name"), context)
        api = config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
    except config.ConfigException as exc:
        raise TimelineError(f"no usable kubeconfig: {exc}") from exc
    try:
        job = client.CustomObjectsApi(api).get_namespaced_custom_object(
            models.GROUP, models.VERSION, namespace, models.PLURAL, name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            raise TimelineError(f"elasticjob {namespace}/{name} not found") from exc
        raise TimelineError(
            f"reading elasticjob {namespace}/{name}: {exc.status} {exc.reason}"
        ) from exc
    except HTTPError as exc:
        raise TimelineError(
            f"reading elasticjob {namespace}/{name}: no answer from the API server ({exc})"
        ) from exc
    finally:
        api.close()
    assert isinstance(job, dict)
    return job


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m elasticjob_operator.timeline"
) -> int:
    args = parser(prog).parse_args(argv)
    try:
        job = read_job(args.job, args.namespace, args.kubeconfig, args.context)
        meta = job.get("metadata") or {}
        picture = series(job_goodput(job), f"{meta.get('namespace')}/{args.job}")
        path = draw(picture, args.output or Path(f"{args.job}-timeline.png"))
    except TimelineError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(path.resolve())
    return 0


def kubectl_plugin() -> int:
    """``kubectl elasticjob-timeline``: kubectl runs ``kubectl-elasticjob_timeline`` from
    the PATH with the arguments after the plugin's name."""
    return main(prog="kubectl elasticjob-timeline")


if __name__ == "__main__":
    sys.exit(main())
