"""The checkpoint-stall scenario's pure parts: sizes, and figures built from samples."""

from __future__ import annotations

import pytest

from bench.checkpoint_stall import (
    BASELINE,
    Case,
    Sample,
    figures,
    layers_for,
    parse_size,
    size_label,
)


def sample(blocked: float, baseline: float, **kw: float) -> Sample:
    values: dict[str, float] = dict(
        first_blocked_s=0.5,
        memcpy_s=0.01,
        durable_s=2.0,
        restore_memory_s=0.3,
        restore_disk_s=1.2,
        load1=2.0,
        state_bytes=100_000_000,
    )
    values.update(kw)
    return Sample(baseline_s=baseline, blocked_s=blocked, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "nbytes", "label"),
    [
        ("100MB", 100_000_000, "100 MB"),
        ("1GB", 1_000_000_000, "1 GB"),
        ("1gb", 1_000_000_000, "1 GB"),
        ("512MiB", 512 * 2**20, "512 MiB"),
        ("1.5 GiB", int(1.5 * 2**30), "1.5 GiB"),
        ("64 kB", 64_000, "64 KB"),
    ],
)
def test_sizes_are_parsed_in_decimal_or_binary_units(text: str, nbytes: int, label: str) -> None:
    assert parse_size(text) == nbytes
    assert size_label(text) == label


@pytest.mark.parametrize("text", ["100", "MB", "1 TB", "-1GB", "0MB", "1,5GB"])
def test_a_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_layers_add_up_to_the_size_with_adams_two_moments() -> None:
    per_layer = 12 * (1024 * 1024 + 1024)  # weights + bias, float32, x3 with exp_avg(_sq)
    assert layers_for(100_000_000) == round(100_000_000 / per_layer) == 8
    assert layers_for(1_000_000_000) == 79
    assert layers_for(1) == 1


def test_the_stall_figure_holds_every_sample_and_meets_5_percent_by_the_medians() -> None:
    samples = [sample(0.04, 1.0), sample(0.9, 1.2), sample(0.05, 1.1)]  # one noisy outlier
    stall, restore = figures(Case("1GB", samples, ["repetition 3: OSError: disk full"]))
    assert (stall.scenario, stall.case, stall.unit) == ("checkpoint-stall", "1 GB", "s")
    assert stall.ours == [0.04, 0.9, 0.05] and stall.baseline == [1.0, 1.2, 1.1]
    assert stall.baseline_name == BASELINE == "torch.save (synchronous)"
    assert stall.target == "<= 5 % of baseline"
    assert stall.ours_median == 0.05 and stall.baseline_median == 1.1
    assert stall.met is True  # 0.05 <= 0.055
    assert stall.failures == ["repetition 3: OSError: disk full"]
    assert "100 MB of model + Adam state" in stall.note and "load 2.0-2.0" in stall.note
    assert restore.ours == [0.3, 0.3, 0.3] and restore.baseline == [1.2, 1.2, 1.2]
    assert restore.target is None and restore.met is None


def test_a_stall_above_5_percent_of_the_baseline_misses() -> None:
    (stall, _) = figures(Case("100MB", [sample(0.06, 1.0), sample(0.051, 1.0)], []))
    assert stall.ours_median == pytest.approx(0.0555)
    assert stall.met is False


def test_nothing_measured_is_neither_met_nor_missed() -> None:
    stall, restore = figures(Case("1GB", [], ["repetition 0: MemoryError: "]))
    assert stall.ours == [] and stall.met is None and restore.met is None
    assert stall.failures == ["repetition 0: MemoryError: "]
