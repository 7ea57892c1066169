"""``--scenarios`` names a group of scenarios as well as one scenario."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def expand(scenarios: Iterable[str], group: str, members: Sequence[str]) -> list[str]:
    """``scenarios`` with ``group`` replaced by its ``members``, duplicates dropped."""
    out: list[str] = []
    for name in scenarios:
        for one in members if name == group else (name,):
            if one not in out:
                out.append(one)
    return out
