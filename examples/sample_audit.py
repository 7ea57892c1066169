"""Reads the examples' ``samples`` and ``committed`` lines back and says whether a run saw
every sample exactly once per epoch across its faults and resizes.

With ``--log-samples 1`` every rank logs, for every step, two lines:

- ``samples step=N epoch=E world=W rank=R round=K idx=i,j,... t=T`` as the step starts,
  before any collective: a rank killed inside the step has already said what it trained
  on, and its peers can only commit the step if it got as far as its collective;
- ``committed step=N round=K rank=R t=T`` once the step committed on that rank.

``round=K`` is ``Run.round_id``, the rendezvous round the group formed in: an attempt at a
step is the ``samples`` lines of one step and one round, and it counted when any of its
ranks logged ``committed``. A dropped attempt (no ``committed``) is redone in a later
round; a step redone after a restart from a checkpoint counts again, and its last attempt
stands. The e2e tests, the soak (``bench/soak.py``) and the integration tests feed their
lines here. Pure: lines in, findings out, so the rule is written once and a unit test
can break it on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

SAMPLES_PREFIX = "samples step="
COMMITTED_PREFIX = "committed step="


@dataclass(frozen=True)
class Samples:
    """One rank's batch in one attempt at a step."""

    step: int
    epoch: int
    world: int
    rank: int
    round: str
    idx: tuple[int, ...]
    t: float


@dataclass(frozen=True)
class Committed:
    """One rank committed the step it ran in ``round``."""

    step: int
    round: str
    rank: int
    t: float


Record = Samples | Committed


def samples_line(
    step: int, epoch: int, world: int, rank: int, round_id: str, idx: Iterable[int], t: float
) -> str:
    """The line a rank logs as a step starts (the examples write it with this)."""
    ids = ",".join(str(i) for i in idx)
    return (
        f"samples step={step} epoch={epoch} world={world} rank={rank} round={round_id} "
        f"idx={ids} t={t:.3f}"
    )


def committed_line(step: int, round_id: str, rank: int, t: float) -> str:
    """The line a rank logs once the step committed."""
    return f"committed step={step} round={round_id} rank={rank} t={t:.3f}"


def parse(line: str) -> Record | None:
    """The record a line carries; None for any other (or a torn) line."""
    if not line.startswith((SAMPLES_PREFIX, COMMITTED_PREFIX)):
        return None
    fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
    try:
        if line.startswith(COMMITTED_PREFIX):
            return Committed(
                int(fields["step"]), fields["round"], int(fields["rank"]), float(fields["t"])
            )
        return Samples(
            int(fields["step"]),
            int(fields["epoch"]),
            int(fields["world"]),
            int(fields["rank"]),
            fields["round"],
            tuple(int(i) for i in fields["idx"].split(",") if i),
            float(fields["t"]),
        )
    except (KeyError, ValueError):
        return None


def parse_all(lines: Iterable[str]) -> list[Record]:
    """Every record among ``lines``, oldest first."""
    return sorted((r for r in map(parse, lines) if r is not None), key=lambda r: r.t)


def committed_attempts(records: Iterable[Record]) -> dict[int, list[list[Samples]]]:
    """Per step, the ``samples`` records of each attempt that committed, oldest first (a
    step trained twice, after a restart from an older checkpoint, has two)."""
    records = list(records)
    stood = {(r.step, r.round): r.t for r in records if isinstance(r, Committed)}
    by_attempt: dict[tuple[int, str], list[Samples]] = {}
    for r in records:
        if isinstance(r, Samples) and (r.step, r.round) in stood:
            by_attempt.setdefault((r.step, r.round), []).append(r)
    out: dict[int, list[list[Samples]]] = {}
    for (step, _), recs in sorted(by_attempt.items(), key=lambda kv: stood[kv[0]]):
        out.setdefault(step, []).append(sorted(recs, key=lambda r: r.rank))
    return out


@dataclass(frozen=True)
class Audit:
    """What the records show: ``problems`` is empty when every step 1..steps has one
    complete attempt that committed and no epoch repeats a sample (or, once over, skips
    one)."""

    problems: list[str] = field(default_factory=list)
    epochs: int = 0
    worlds: list[int] = field(default_factory=list)  # world size of each step, in order
    resized_in_epoch: frozenset[int] = frozenset()  # epochs with a resize inside them


def audit(records: Iterable[Record], samples: int, steps: int) -> Audit:
    """Check a finished run of ``steps`` steps over a data set of ``samples`` samples."""
    final = {step: tries[-1] for step, tries in committed_attempts(records).items()}
    problems = []
    missing = sorted(set(range(1, steps + 1)) - set(final))
    if missing:
        problems.append(f"{len(missing)} steps have no committed record (first {missing[:5]})")
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
        if [r.rank for r in recs] != list(range(world)) or {r.world for r in recs} != {world}:
            ranks = [(r.rank, r.world) for r in recs]
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
