"""pytest imports test modules by basename (rootdir-relative, no packages): two test
files of one name anywhere under tests/ stop the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_every_test_module_has_a_name_of_its_own() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1]
