"""Reads the example's ``samples step= ... idx=`` lines back and says whether a run saw
every sample exactly once per epoch across its faults and resizes.

``train_regression.py --log-samples 1`` makes every rank log the sample indices of every
step; the e2e tests and the soak (``bench/soak.py``) feed those lines here. Pure: lines in,
findings out, so the rule is written once and a unit test can break it on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

SAMPLES_PREFIX = "samples step="
# The ranks of one attempt at a step log within moments of each other (they have just
# met in an allreduce); a redone attempt comes a restart later.
ATTEMPT_WINDOW_S = 1.0


@dataclass(frozen=True)
class Samples:
    """``samples step=N epoch=E world=W rank=R idx=i,j,... t=T`` (one rank, one step)."""

    step: int
    epoch: int
    world: int
    rank: int
    idx: tuple[int, ...]
    t: float


def parse(line: str) -> Samples | None:
    """The record a ``samples`` line carries; None for any other (or a torn) line."""
    if not line.startswith(SAMPLES_PREFIX):
        return None
    fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
    try:
        return Samples(
            int(fields["step"]),
            int(fields["epoch"]),
            int(fields["world"]),
            int(fields["rank"]),
            tuple(int(i) for i in fields["idx"].split(",") if i),
            float(fields["t"]),
        )
    except (KeyError, ValueError):
        return None


def parse_all(lines: Iterable[str]) -> list[Samples]:
    """Every record among ``lines``, oldest first."""
    return sorted((r for r in map(parse, lines) if r is not None), key=lambda r: r.t)


def final_attempts(records: Iterable[Samples]) -> dict[int, list[Samples]]:
    """Per step, the records of the attempt that counted: a step redone after a restart
    from a checkpoint replaces the earlier attempt."""
    by_step: dict[int, list[Samples]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    final = {}
    for step, recs in by_step.items():
        last = max(r.t for r in recs)
        final[step] = [r for r in recs if r.t > last - ATTEMPT_WINDOW_S]
    return final


@dataclass(frozen=True)
class Audit:
    """What the records show: ``problems`` is empty when every step 1..steps has one
    complete attempt and no epoch repeats a sample (or, once over, skips one)."""

    problems: list[str] = field(default_factory=list)
    epochs: int = 0
    worlds: list[int] = field(default_factory=list)  # world size of each step, in order
    resized_in_epoch: frozenset[int] = frozenset()  # epochs with a resize inside them


def audit(records: Iterable[Samples], samples: int, steps: int) -> Audit:
    """Check a finished run of ``steps`` steps over a data set of ``samples`` samples."""
    final = final_attempts(records)
    problems = []
    missing = sorted(set(range(1, steps + 1)) - set(final))
    if missing:
        problems.append(f"{len(missing)} steps have no record (first {missing[:5]})")
    extra = sorted(set(final) - set(range(1, steps + 1)))
    if extra:
        problems.append(f"records of steps beyond {steps}: {extra[:5]}")
    by_epoch: dict[int, list[int]] = {}
    worlds: list[int] = []
    resized: set[int] = set()
    previous: Samples | None = None
    for step in sorted(final):
        recs = final[step]
        world, epoch = recs[0].world, recs[0].epoch
        worlds.append(world)
        if sorted(r.rank for r in recs) != list(range(world)) or {r.world for r in recs} != {world}:
            ranks = sorted((r.rank, r.world) for r in recs)
            problems.append(f"step {step}: ranks (rank, world) {ranks} are not one full group")
        if {r.epoch for r in recs} != {epoch}:
            problems.append(f"step {step}: ranks disagree on the epoch")
        seen = by_epoch.setdefault(epoch, [])
        for r in recs:
            seen += r.idx
        if previous is not None and previous.world != world and previous.epoch == epoch:
            resized.add(epoch)
        previous = recs[0]
    for epoch, seen in sorted(by_epoch.items()):
        repeated = len(seen) - len(set(seen))
        if repeated:
            problems.append(f"epoch {epoch}: {repeated} samples repeated")
        if epoch < max(by_epoch) and sorted(set(seen)) != list(range(samples)):
            problems.append(f"epoch {epoch}: {samples - len(set(seen))} samples skipped")
    return Audit(problems, len(by_epoch), worlds, frozenset(resized))
