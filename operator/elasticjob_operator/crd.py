"""Generate the ElasticJob CustomResourceDefinition from the pydantic models.

`python -m elasticjob_operator.crd --write PATH...` writes the YAML (``make crds``);
`--check PATH...` exits 1 when a committed copy differs from what the models say.

The JSON Schema pydantic emits is turned into a Kubernetes *structural* schema: refs
inlined, ``Optional`` unwrapped, ``int | str`` made ``x-kubernetes-int-or-string``, open
objects (``extra="allow"``, ``dict[str, Any]``) made ``x-kubernetes-preserve-unknown-fields``,
titles dropped, descriptions kept for ``kubectl explain``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from elasticjob_operator import models

Schema = dict[str, Any]

HEADER = "# Generated from operator/elasticjob_operator/models.py by `make crds`; do not edit.\n"


def _resolve(node: Any, defs: dict[str, Schema]) -> Any:
    """Inline every $ref (the models have no recursion)."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**_resolve(target, defs)}
        merged.update({k: _resolve(v, defs) for k, v in node.items() if k != "$ref"})
        return merged
    return {k: _resolve(v, defs) for k, v in node.items()}


_DROP = {"title", "discriminator"}


def _structural(node: Schema) -> Schema:
    """Rewrite one resolved pydantic schema node into a structural one."""
    out: Schema = {k: v for k, v in node.items() if k not in _DROP}
    for key in ("anyOf", "oneOf"):
        if key not in out:
            continue
        branches = [b for b in out.pop(key) if b.get("type") != "null"]
        if out.get("default", "x") is None:
            del out["default"]
        types = sorted(b.get("type", "") for b in branches)
        if len(branches) == 1:
            inner = _structural(branches[0])
            # the field's own description wins over the type's docstring
            inner.update({k: v for k, v in out.items() if k != "type"})
            return _structural_tail(inner)
        if types == ["integer", "string"]:
            out["x-kubernetes-int-or-string"] = True
            return _structural_tail(out)
        raise ValueError(f"cannot express {branches} in a structural schema")
    return _structural_tail(out)


def _structural_tail(out: Schema) -> Schema:
    if "properties" in out:
        out["properties"] = {k: _structural(v) for k, v in out["properties"].items()}
        out.setdefault("type", "object")
    if "items" in out:
        out["items"] = _structural(out["items"])
    if "description" in out:
        out["description"] = " ".join(str(out["description"]).split())
    extra = out.get("additionalProperties")
    if extra is False:  # extra="forbid": structural schemas prune unknown fields anyway
        del out["additionalProperties"]
    elif extra is True or (out.get("type") == "object" and "properties" not in out and not extra):
        out.pop("additionalProperties", None)
        out["x-kubernetes-preserve-unknown-fields"] = True
        out["type"] = "object"
    elif isinstance(extra, dict):
        out["additionalProperties"] = _structural(extra)
    if "const" in out:  # Literal with one value
        out["enum"] = [out.pop("const")]
    if out.get("format") == "date-time":
        out.pop("default", None)
    return out


def _model_schema(model: type[models._Model]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


def spec_schema() -> Schema:
    schema = _model_schema(models.ElasticJobSpec)
    schema["x-kubernetes-validations"] = [
        {"rule": r.cel, "message": r.message, "fieldPath": r.field_path} for r in models.SPEC_RULES
    ]
    return schema


def status_schema() -> Schema:
    return _model_schema(models.ElasticJobStatus)


def openapi_schema() -> Schema:
    return {
        "type": "object",
        "description": " ".join((models.ElasticJob.__doc__ or "").split()),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "elastic.pytorch.org/v1alpha1"},
            "kind": {"type": "string", "description": "ElasticJob"},
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "x-kubernetes-validations": [
                            {"rule": rule.replace("self.metadata.name", "self"), "message": message}
                            for rule, message in models.NAME_RULES
                        ],
                    }
                },
            },
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }


PRINTER_COLUMNS: list[Schema] = [
    {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicas"},
    {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicas"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicaSpecs.Worker.replicas"},
    {"name": "Active", "type": "integer", "jsonPath": ".status.replicaStatuses.Worker.active"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # `kubectl get -o wide`: only a job in a Kueue queue has it (docs/scheduling.md)
    {
        "name": "Admitted",
        "type": "integer",
        "jsonPath": ".status.admittedReplicas",
        "priority": 1,
    },
    {"name": "Placement", "type": "string", "jsonPath": ".status.placement", "priority": 1},
    # training over wall time, from the runtime's ledger (docs/goodput.md)
    {"name": "Goodput", "type": "string", "jsonPath": ".status.goodput.percent", "priority": 1},
]


def crd() -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{models.PLURAL}.{models.GROUP}"},
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicaSpecs.Worker.replicas",
                            "statusReplicasPath": ".status.replicaStatuses.Worker.active",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", nargs="+", type=Path, metavar="PATH")
    group.add_argument("--check", nargs="+", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        for path in args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return 0
    stale = [p for p in args.check if not p.exists() or p.read_text() != text]
    for p in stale:
        print(f"{p} is out of date with the models: run `make crds`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
