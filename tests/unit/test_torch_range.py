"""The supported torch range is stated once and tested at both ends.

pyproject.toml's floor is the torch scripts/oldest-torch.sh tests in CI, and
constraints.txt's pin (the newest, what the main venv runs) is inside the range: a floor
raised or lowered in one place only would claim a torch nobody tested.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split("."))


def test_the_floor_is_the_oldest_torch_ci_tests() -> None:
    runtime = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["runtime"]
    (floor,) = [
        re.fullmatch(r"torch>=([\d.]+)", dep)[1] for dep in runtime if dep.startswith("torch")
    ]  # type: ignore[index]
    script = (REPO / "scripts" / "oldest-torch.sh").read_text()
    oldest = re.search(r"^OLDEST_TORCH=([\d.]+)$", script, re.M)
    assert oldest, "scripts/oldest-torch.sh names no OLDEST_TORCH"
    assert _release(oldest[1])[:2] == _release(floor)[:2], (
        f"pyproject.toml says torch>={floor}, scripts/oldest-torch.sh tests {oldest[1]}"
    )
    pinned = re.search(r"^torch==([\d.]+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned and _release(pinned[1]) >= _release(oldest[1]), pinned
