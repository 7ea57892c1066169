"""The docs stay true to the tree: docs/architecture.md names every module, every relative
link in the docs leads to a file of this repository, and no doc sends a reader to a
document outside it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = (
    "operator/elasticjob_operator",
    "operator/elasticjob_operator/etcd",
    "operator/elasticjob_operator/kueue",
    "trainer-runtime/elasticjob_runtime",
    "trainer-runtime/elasticjob_runtime/training",
    "trainer-runtime/elasticjob_runtime/launch",
    "trainer-runtime/elasticjob_runtime/rendezvous",
    "trainer-runtime/elasticjob_runtime/etcd",
    "trainer-runtime/elasticjob_runtime/checkpoints",
    "trainer-runtime/elasticjob_runtime/goodput",
    "devcluster/elasticjob_devcluster",
    "pki/elasticjob_pki",
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


def within_package(module: str) -> str:
    """A module's path within its top package: ``etcd/certs.py`` for a subpackage's, so
    it is not taken for another package's ``certs.py``."""
    return next(
        str(Path(module).relative_to(package))
        for package in PACKAGES
        if Path(module).is_relative_to(package)
    )


def test_every_subpackage_is_documented_and_installed() -> None:
    """A subpackage left out of pyproject's list is missing from the installed package
    (and the images) while the tests, run from the checkout, still pass."""
    installed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    for top in ("operator/elasticjob_operator", "trainer-runtime/elasticjob_runtime"):
        for init in (REPO / top).rglob("__init__.py"):
            package = str(init.parent.relative_to(REPO))
            assert package in PACKAGES, (
                f"add {package} to PACKAGES here and to docs/architecture.md"
            )
            dotted = ".".join(init.parent.relative_to(REPO / top).parts)
            name = Path(top).name + (f".{dotted}" if dotted else "")
            assert name in installed, f"pyproject.toml's packages lack {name}"


@pytest.mark.parametrize("module", modules())
def test_the_architecture_page_names_every_module(module: str) -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    assert f"`{within_package(module)}`" in page or f"`{module}`" in page, (
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


# `e2e/test_x.py` or `e2e/test_x.py::test_name` (paths under tests/), as README and
# docs/faults.md name the proof of each promise
TEST_REF = re.compile(r"`((?:unit|integration|e2e)/[\w/]+\.py|test_\w+\.py)(?:::(test_\w+))?")


def test_every_test_a_guarantee_names_exists() -> None:
    """A renamed or deleted test must take its promise with it, or say what proves it now."""
    texts = [(REPO / "README.md").read_text(), (REPO / "docs" / "faults.md").read_text()]
    named = {m.groups() for text in texts for m in TEST_REF.finditer(text)}
    assert len(named) >= 20, "the Guarantees section and docs/faults.md name their tests"
    missing = []
    for path, name in sorted(named, key=str):
        files = [REPO / "tests" / path] if "/" in path else list(REPO.glob(f"tests/**/{path}"))
        found = [f for f in files if f.is_file()]
        if not found:
            missing.append(path)
        elif name and not any(f"def {name}(" in f.read_text() for f in found):
            missing.append(f"{path}::{name}")
    assert not missing, f"named as proof but not found: {missing}"
