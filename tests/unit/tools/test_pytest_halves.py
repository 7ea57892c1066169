"""`make test`'s two pytest halves (scripts/pytest-halves): what their exit codes add up
to. A stand-in ``pytest`` on PATH exits with the code each half is given, so only the
script's own rule runs here; `make test` runs it for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "pytest-halves"

STAND_IN = """#!/usr/bin/env bash
echo "collected by $1: $*"
if [[ $1 == tests/e2e ]]; then exit "$E2E_RC"; else exit "$REST_RC"; fi
"""


@pytest.mark.parametrize(
    ("e2e", "rest", "expected"),
    [
        (0, 0, 0),
        (5, 0, 0),  # a -k that selects only tests of the other half
        (0, 5, 0),
        (5, 5, 1),  # neither collected a test: a failure, not a pass
        (1, 0, 1),
        (0, 2, 2),
        (1, 5, 1),
    ],
)
def test_the_halves_pass_together_and_collecting_nothing_anywhere_fails(
    tmp_path: Path, e2e: int, rest: int, expected: int
) -> None:
    stand_in = tmp_path / "pytest"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.update(E2E_RC=str(e2e), REST_RC=str(rest))
    done = subprocess.run(
        [str(SCRIPT), "-k", "x"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == expected, done.stdout + done.stderr
    # both halves ran, with the arguments, each line marked with its half
    assert "[e2e] collected by tests/e2e: tests/e2e -k x" in done.stdout
    assert (
        "[rest] collected by tests: tests --ignore=tests/e2e --ignore=tests/images -k x"
        in done.stdout
    )
    assert ("collected no tests" in done.stderr) == (e2e == rest == 5)
