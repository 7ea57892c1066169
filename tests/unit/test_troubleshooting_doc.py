"""docs/troubleshooting.md quotes the messages users meet so they can search for them; a
message reworded in the code would leave the page quoting words nobody sees. So every
``> message: `...` `` line must still occur, literally, in the operator's or the
runtime's source."""

from __future__ import annotations

from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
SOURCES = ("operator", "trainer-runtime")
PREFIX = "> message: "
MIN_MESSAGES = 12


def quoted_messages(page: Path) -> list[str]:
    """Each fragment the page quotes, without the prefix and the backticks around it."""
    fragments = []
    for line in page.read_text().splitlines():
        if line.startswith(PREFIX):
            fragment = line.removeprefix(PREFIX).strip()
            if len(fragment) >= 2 and fragment.startswith("`") and fragment.endswith("`"):
                fragment = fragment[1:-1]
            fragments.append(fragment)
    return fragments


@cache
def source_texts() -> tuple[str, ...]:
    """The text of every .py file under the operator and the trainer runtime."""
    return tuple(
        path.read_text(encoding="utf-8")
        for top in SOURCES
        for path in sorted((REPO / top).rglob("*.py"))
    )


def test_the_page_quotes_enough_messages() -> None:
    messages = quoted_messages(PAGE)
    assert len(messages) >= MIN_MESSAGES, (
        f"docs/troubleshooting.md quotes {len(messages)} messages; expected at least {MIN_MESSAGES}"
    )
    assert all(messages), "an empty '> message:' line in docs/troubleshooting.md"


def test_every_quoted_message_exists_in_the_code() -> None:
    texts = source_texts()
    missing = [m for m in quoted_messages(PAGE) if not any(m in text for text in texts)]
    assert not missing, (
        "docs/troubleshooting.md quotes messages no longer in operator/ or trainer-runtime/ "
        f"(reword the page to match the code): {missing}"
    )
