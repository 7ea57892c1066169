"""Container log files in kubelet's CRI format, and slicing them for `kubectl logs`.

Each line on disk is `<RFC3339Nano time> <stream> <F|P> <content>`: F ends a line,
P is a piece of a line still being written. Keeping a time per line is what lets the
log endpoint honour sinceSeconds/sinceTime and timestamps=true.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass


def timestamp(t: float) -> str:
    """RFC3339 with nanosecond digits, as kubelet writes it."""
    d = dt.datetime.fromtimestamp(t, dt.UTC)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"


def parse_time(s: str) -> float:
    """Seconds since the epoch of an RFC3339 time (fraction up to nanoseconds)."""
    s = s.strip()
    if s.endswith("Z"):
        s = s[:-1] + "+00:00"
    main, _, rest = s.partition(".")
    if rest:
        digits = "".join(ch for ch in rest if ch.isdigit())
        tz = rest[len(digits) :]
        s = f"{main}.{digits[:6].ljust(6, '0')}{tz}"
    return dt.datetime.fromisoformat(s).timestamp()


def encode_chunk(data: bytes, stream: str, now: float) -> bytes:
    """CRI lines for one chunk read from a container's stdout or stderr.

    A tail without a newline is written at once as a partial (P) line, so output that
    has not ended its line yet still shows up in `kubectl logs -f`.
    """
    ts = timestamp(now).encode()
    out = bytearray()
    pieces = data.split(b"\n")
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if last and not piece:
            break
        tag = b"P" if last else b"F"
        out += ts + b" " + stream.encode() + b" " + tag + b" " + piece + b"\n"
    return bytes(out)


@dataclass(frozen=True)
class Entry:
    time: float
    stamp: str
    stream: str
    full: bool
    content: bytes


def parse(raw: bytes) -> list[Entry]:
    """Entries of a CRI log file; a malformed line (never written by us) is skipped."""
    out = []
    for line in raw.split(b"\n"):
        parts = line.split(b" ", 3)
        if len(parts) < 3:
            continue
        stamp = parts[0].decode(errors="replace")
        try:
            t = parse_time(stamp)
        except ValueError:
            continue
        content = parts[3] if len(parts) == 4 else b""
        out.append(Entry(t, stamp, parts[1].decode(), parts[2] == b"F", content))
    return out


@dataclass(frozen=True)
class Line:
    """One line rebuilt from its pieces: the time of its first piece; ``full`` once its
    end arrived."""

    stamp: str
    time: float
    stream: str
    content: bytes
    full: bool


def assemble(
    entries: Iterable[Entry], partial: dict[str, Line] | None = None
) -> tuple[list[Line], dict[str, Line]]:
    """The complete lines among ``entries`` (in the order they ended), and the pieces
    still waiting for their end, per stream. Each stream is rebuilt on its own: a piece
    of stdout continues with the next stdout entry, never with a stderr line written
    between its pieces (a worker printing while its launcher logs). ``partial`` carries
    the waiting pieces over from the previous call (``kubectl logs -f``)."""
    waiting = dict(partial or {})
    lines = []
    for e in entries:
        start = waiting.pop(e.stream, None)
        line = (
            Line(start.stamp, start.time, e.stream, start.content + e.content, e.full)
            if start is not None
            else Line(e.stamp, e.time, e.stream, e.content, e.full)
        )
        if e.full:
            lines.append(line)
        else:
            waiting[e.stream] = line
    return lines, waiting


def unfinished(partial: dict[str, Line]) -> list[Line]:
    """The waiting pieces as lines without their end, oldest first (what a log that
    stops mid-line shows last)."""
    return sorted(partial.values(), key=lambda line: line.time)


def render(
    entries: Iterable[Entry],
    *,
    timestamps: bool = False,
    tail_lines: int | None = None,
    since: float | None = None,
    limit_bytes: int | None = None,
) -> bytes:
    """What `kubectl logs` prints: lines rebuilt from pieces, then filtered and cut."""
    lines, partial = assemble(entries)
    return format_lines(
        lines + unfinished(partial),
        timestamps=timestamps,
        tail_lines=tail_lines,
        since=since,
        limit_bytes=limit_bytes,
    )


def format_lines(
    lines: list[Line],
    *,
    timestamps: bool = False,
    tail_lines: int | None = None,
    since: float | None = None,
    limit_bytes: int | None = None,
) -> bytes:
    if since is not None:
        lines = [ln for ln in lines if ln.time >= since]
    if tail_lines is not None:
        lines = lines[-tail_lines:] if tail_lines > 0 else []
    out = bytearray()
    for line in lines:
        if timestamps:
            out += line.stamp.encode() + b" "
        out += line.content
        if line.full:
            out += b"\n"
    if limit_bytes is not None:
        return bytes(out[:limit_bytes])
    return bytes(out)
