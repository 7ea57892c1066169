"""Write docs/api.md: every public name of ``elasticjob_runtime`` with its signature and
docstring, generated so it cannot drift (tests/unit/runtime/test_api_reference.py fails
when the file is not what this writes).

    python scripts/api_reference.py          # rewrite docs/api.md
    python scripts/api_reference.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "api.md"
# The order a reader needs them in: the loop, its data, its checkpoints, its errors.
ORDER = (
    "Run",
    "StepOutcome",
    "ElasticSampler",
    "CheckpointManager",
    "StepBrokeAfterUpdate",
    "DivergenceError",
    "CheckpointError",
    "UnsafeCheckpointError",
)
# what the docs call an instance of each class
INSTANCE = {"Run": "run", "ElasticSampler": "sampler", "CheckpointManager": "ckpt"}
HEADER = """# API reference

Generated from the code by `python scripts/api_reference.py` (a test fails when this file
is stale): every name `elasticjob_runtime` exports, its signature and its docstring. How
the pieces fit together: [training-loop.md](training-loop.md).

```python
from elasticjob_runtime import Run, ElasticSampler, CheckpointManager
```
"""


def markdown(doc: str) -> str:
    """reST roles and double backticks as Markdown code."""
    doc = re.sub(r":(?:class|meth|mod|func|data|attr|exc):`~?([^`]+)`", r"`\1`", doc)
    return doc.replace("``", "`")


def parameter(p: inspect.Parameter) -> str:
    """One parameter as written in the source (annotations are strings there)."""
    prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
    text = prefix + p.name
    if p.annotation is not p.empty:
        shown = p.annotation if isinstance(p.annotation, str) else repr(p.annotation)
        text += f": {shown}"
    if p.default is not p.empty:
        text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
    return text


def signature(name: str, obj: Any, *, skip_self: bool = False) -> str:
    """``name(params) -> returns``, one parameter a line when it would not fit in 90."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = list(sig.parameters.values())
    if skip_self and params and params[0].name == "self":
        params = params[1:]
    parts: list[str] = []
    for i, p in enumerate(params):
        first_keyword = p.kind is p.KEYWORD_ONLY and (
            i == 0 or params[i - 1].kind is not p.KEYWORD_ONLY
        )
        if first_keyword and not any(q.kind is q.VAR_POSITIONAL for q in params):
            parts.append("*")
        parts.append(parameter(p))
        if p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    returns = sig.return_annotation
    tail = "" if returns in (sig.empty, "None") or inspect.isclass(obj) else f" -> {returns}"
    one_line = f"{name}({', '.join(parts)}){tail}"
    if len(one_line) <= 90:
        return one_line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{name}(\n{body}){tail}"


def members(cls: type) -> list[tuple[str, Any]]:
    """The class's own public methods and properties, in source order."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property) or inspect.isfunction(value):
            found.append((name, value))
    return found


def member_section(owner: str, name: str, value: Any) -> list[str]:
    doc = markdown(inspect.getdoc(value) or "(no docstring)")
    if isinstance(value, property):
        returns = inspect.signature(value.fget).return_annotation if value.fget else ""
        kind = f": {returns}" if returns is not inspect.Signature.empty else ""
        return [f"#### `{owner}.{name}{kind}` (property)", "", doc, ""]
    return [f"#### `{owner}.{name}`", "", "```python", signature(name, value, skip_self=True),
            "```", "", doc, ""]  # fmt: skip


def class_section(name: str, cls: type) -> list[str]:
    lines = [f"## `{name}`", ""]
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if issubclass(cls, BaseException):
        lines += [f"An exception (a subclass of `{', '.join(bases)}`).", ""]
    else:
        lines += ["```python", signature(name, cls), "```", ""]
    lines += [markdown(inspect.getdoc(cls) or "(no docstring)"), ""]
    init = vars(cls).get("__init__")
    own = init is not None and inspect.getdoc(init) != inspect.getdoc(object.__init__)
    if own and inspect.getdoc(init) and not issubclass(cls, BaseException):
        lines += [markdown(inspect.getdoc(init) or ""), ""]
    if "__enter__" in vars(cls):
        lines += [f"`with {name}(...) as x:` enters it and finishes it when the block ends.", ""]
    owner = INSTANCE.get(name, name)
    for member, value in members(cls):
        lines += member_section(owner, member, value)
    return lines


def render() -> str:
    import elasticjob_runtime

    names = list(elasticjob_runtime.__all__)
    missing = sorted(set(names) - set(ORDER))
    if missing:
        raise SystemExit(f"add {missing} to ORDER in scripts/api_reference.py")
    lines = [HEADER]
    for name in ORDER:
        lines += class_section(name, getattr(elasticjob_runtime, name))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        stale = not TARGET.exists() or TARGET.read_text() != text
        if stale:
            print(f"{TARGET} is stale: run python scripts/api_reference.py", file=sys.stderr)
        return 1 if stale else 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
