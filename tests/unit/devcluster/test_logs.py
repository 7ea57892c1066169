"""Container logs round-trip through the CRI file format and slice like kubectl logs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticjob_devcluster.logs import assemble, encode_chunk, parse, parse_time, render, timestamp


def test_timestamp_round_trips_to_the_microsecond() -> None:
    t = 1_790_000_000.123456
    assert abs(parse_time(timestamp(t)) - t) < 1e-6
    assert parse_time("2026-01-01T00:00:00.123456789Z") == parse_time("2026-01-01T00:00:00.123456Z")


@settings(deadline=None)  # no wall-clock bound: the suites share two cores
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_any_chunking_renders_back_to_the_bytes_written(chunks: list[bytes]) -> None:
    raw = b"".join(encode_chunk(c, "stdout", 1000.0 + i) for i, c in enumerate(chunks))
    assert render(parse(raw)) == b"".join(chunks)


def test_tail_since_limit_and_timestamps() -> None:
    raw = encode_chunk(b"a\nb\n", "stdout", 100.0) + encode_chunk(b"c\n", "stderr", 200.0)
    entries = parse(raw)
    assert render(entries, tail_lines=2) == b"b\nc\n"
    assert render(entries, tail_lines=0) == b""
    assert render(entries, since=150.0) == b"c\n"
    assert render(entries, limit_bytes=3) == b"a\nb"
    stamped = render(entries, timestamps=True).decode().splitlines()
    assert stamped[2] == timestamp(200.0) + " c"


def test_partial_line_joins_with_its_end() -> None:
    raw = encode_chunk(b"progress 1", "stdout", 1.0) + encode_chunk(b"0%\nnext\n", "stdout", 2.0)
    assert render(parse(raw), tail_lines=1) == b"next\n"
    assert render(parse(raw)) == b"progress 10%\nnext\n"


def test_a_line_split_across_reads_is_not_joined_with_the_other_stream() -> None:
    """A worker's stdout line whose end comes in a second read, with its launcher's
    stderr line written in between: both lines come back whole."""
    raw = (
        encode_chunk(b"samples step=3 idx=1,2", "stdout", 100.0)
        + encode_chunk(b"agent: regrouping\n", "stderr", 100.1)
        + encode_chunk(b",3 t=5\n", "stdout", 100.2)
    )
    assert render(parse(raw)) == b"agent: regrouping\nsamples step=3 idx=1,2,3 t=5\n"


def test_assemble_carries_a_piece_over_to_the_next_call() -> None:
    first, waiting = assemble(parse(encode_chunk(b"half", "stdout", 1.0)))
    assert first == [] and list(waiting) == ["stdout"]
    rest, waiting = assemble(parse(encode_chunk(b" done\n", "stdout", 2.0)), waiting)
    assert [(line.content, line.time, line.full) for line in rest] == [(b"half done", 1.0, True)]
    assert waiting == {}
