"""bench.sharded_stall: the state's size, and the figure held to its target."""

from __future__ import annotations

from bench import sharded_stall
from bench.sharded_stall import Sample


def test_three_tensors_of_the_rows_make_the_size_asked() -> None:
    rows = sharded_stall.rows_for(120_000_000)
    assert abs(3 * 4 * sharded_stall.COLS * rows - 120_000_000) <= 3 * 4 * sharded_stall.COLS
    assert sharded_stall.rows_for(10) == 2  # a row for each of the two ranks at least


def test_the_figure_is_rank_0s_stall_beside_dcp_save_with_the_background_in_the_note() -> None:
    samples = [Sample(1.0, 0.1, 0.9), Sample(1.2, 0.2, 1.1), Sample(0.8, 0.3, 1.0)]
    fig = sharded_stall.figure("100MB", samples)
    assert (fig.ours, fig.baseline, fig.ratio, fig.met) == (
        [0.1, 0.2, 0.3],
        [1.0, 1.2, 0.8],
        0.2,
        True,
    )
    assert "took 1.00 s (median)" in fig.note
    assert not sharded_stall.figure("100MB", [Sample(1.0, 0.5, 0.5)]).met
