"""docs/api.md is what scripts/api_reference.py writes from the code: a renamed parameter,
a new public method or a changed docstring fails here until the reference is rewritten."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "api_reference.py"


def test_the_api_reference_is_the_one_the_code_writes() -> None:
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.TARGET.read_text()
    assert written == module.render(), (
        "docs/api.md is stale: run python scripts/api_reference.py and commit it"
    )
    assert "(no docstring)" not in written, "every public name says what it is for"
