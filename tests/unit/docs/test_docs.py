"""The docs stay true to the tree: docs/architecture.md names every module, every relative
link in the docs leads to a file of this repository, and no doc sends a reader to a
document outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = (
    "operator/elasticjob_operator",
    "trainer-runtime/elasticjob_runtime",
    "devcluster/elasticjob_devcluster",
    "examples",
    "bench",
)
DOCS = sorted(
    [
        *REPO.glob("docs/*.md"),
        *REPO.glob("*.md"),
        REPO / "bench" / "README.md",
        REPO / "examples" / "README.md",
        REPO / "charts" / "elasticjob-operator" / "README.md",
    ]
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def modules() -> list[str]:
    return sorted(
        str(p.relative_to(REPO))
        for package in PACKAGES
        for p in (REPO / package).glob("*.py")
        if p.name != "__init__.py"
    )


@pytest.mark.parametrize("module", modules())
def test_the_architecture_page_names_every_module(module: str) -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    assert f"`{Path(module).name}`" in page or f"`{module}`" in page, (
        f"docs/architecture.md does not mention {module}: add it to the table of its package"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_to_files_of_the_repository(doc: Path) -> None:
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(REPO), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"


def test_no_file_refers_to_the_design_brief_outside_the_repository() -> None:
    tracked = [
        p
        for p in REPO.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".md", ".sh", ".txt", ".toml", ".yaml")
        and not any(part.startswith(".") for part in p.relative_to(REPO).parts)
        and "results" not in p.parts
        and p != Path(__file__).resolve()
    ]
    offenders = [str(p.relative_to(REPO)) for p in tracked if "DESIGN.md" in p.read_text()]
    assert not offenders, f"these refer to a DESIGN.md outside the repo: {offenders}"
