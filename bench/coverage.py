"""The data a faulted run trained: how often each sample went into the model.

An exactly-once sampler trains every sample E or E + 1 times by the time the job is E.x
epochs in, whatever faults came. So the bench counts, over a whole run, how many times
each sample's gradient reached a committed step that the model kept, and reports the
share of samples trained as often as that (``even``), more often (``repeated``: a
stretch of some epoch trained twice) and less often (``missed``: skipped in some epoch).
Counting per sample, not per epoch label, keeps the rule launcher-neutral: a torchft
replica group that restarts counts its epochs from 0 again while its peers go on.

What "kept" means differs by script, and each script's lines say it:

* ours (examples/sample_audit.py's ``samples`` and ``committed`` lines, every rank): the
  last committed attempt of each step stands; an attempt a restart rolled back does not;
* torchft's scripts (bench/torchft_*.py, ``samples step= epoch= group= idx=`` once a step
  committed): a restarted group heals from a live one and so keeps what its peers trained,
  and its lines stand; but where no live group was left to heal from, the job starts over
  from step 0, and a group's step going back in its own log drops its lines from that
  step on (the model they trained is gone).

Pure: lines in, counts out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from elasticjob_examples.sample_audit import (  # type: ignore[import-not-found]
    SAMPLES_PREFIX,
    committed_attempts,
    parse_all,
)


def _torchft_step(line: str) -> tuple[int, list[int]] | None:
    """The step and indices of one torchft ``samples`` line (it names a ``group=``, ours
    a ``rank=``); None for any other line."""
    if not line.startswith(SAMPLES_PREFIX) or " group=" not in line:
        return None
    fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
    try:
        return int(fields["step"]), [int(i) for i in fields["idx"].split(",") if i]
    except (KeyError, ValueError):
        return None


def _torchft_standing(log: Iterable[str]) -> list[int]:
    """The indices one replica group's log trained into the model that survived: a step
    that goes back (the job started over) drops the group's lines from it on."""
    kept: list[tuple[int, list[int]]] = []
    for line in log:
        found = _torchft_step(line.strip())
        if found is None:
            continue
        while kept and kept[-1][0] >= found[0]:
            kept.pop()
        kept.append(found)
    return [i for _, idx in kept for i in idx]


def trained(logs: Iterable[Iterable[str]]) -> list[int]:
    """Every sample index a run trained into its model, once per time, from each node's
    log (ours and torchft's lines may be mixed: each is read by its own rule)."""
    logs = [list(log) for log in logs]
    out: list[int] = []
    for attempts in committed_attempts(parse_all(line for log in logs for line in log)).values():
        for record in attempts[-1]:
            out.extend(record.idx)
    for log in logs:
        out.extend(_torchft_standing(log))
    return out


@dataclass(frozen=True)
class Coverage:
    """How evenly a run trained a data set of ``samples``: shares of the samples."""

    samples: int
    passes: float  # sample trainings / samples: the epochs the run trained
    even: float  # trained floor(passes) or ceil(passes) times
    repeated: float  # more often than that
    missed: float  # less often than that
    extra_trainings: int  # trainings beyond ceil(passes), summed over the samples
    missing_trainings: int  # trainings short of floor(passes), summed


def coverage(indices: Iterable[int], samples: int) -> Coverage:
    """The spread of ``indices`` (from :func:`trained`) over ``range(samples)``."""
    if samples <= 0:
        raise ValueError(f"a data set has at least one sample, not {samples}")
    counts = Counter(indices)
    outside = sorted(i for i in counts if not 0 <= i < samples)
    if outside:
        raise ValueError(f"indices outside the data set of {samples}: {outside[:5]}")
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no sample was trained: does the script log them (--log-samples 1)?")
    low, high = total // samples, -(-total // samples)
    per_sample = [counts.get(i, 0) for i in range(samples)]
    repeated = [c for c in per_sample if c > high]
    missed = [c for c in per_sample if c < low]
    return Coverage(
        samples=samples,
        passes=round(total / samples, 3),
        even=round(1 - (len(repeated) + len(missed)) / samples, 4),
        repeated=round(len(repeated) / samples, 4),
        missed=round(len(missed) / samples, 4),
        extra_trainings=sum(c - high for c in repeated),
        missing_trainings=sum(low - c for c in missed),
    )
