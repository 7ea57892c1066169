"""The generated CRD: committed copies match the models, the schema is structural (the
API server refuses anything else), every field explains itself, and the subresources
point at fields that exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticjob_operator import crd, models

REPO = Path(__file__).resolve().parents[3]
COMMITTED = [
    REPO / "crds/elasticjob.yaml",
    REPO / "charts/elasticjob-operator/crds/elasticjob.yaml",
]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(REPO)))
def test_committed_crd_matches_the_models(path: Path) -> None:
    assert path.read_text() == crd.render(), f"{path} drifted from the models: run `make crds`"


def test_check_mode_reports_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, stale = tmp_path / "good.yaml", tmp_path / "stale.yaml"
    assert crd.main(["--write", str(good), str(stale)]) == 0
    assert crd.main(["--check", str(good)]) == 0
    stale.write_text(stale.read_text().replace("minReplicas", "minimumReplicas"))
    assert crd.main(["--check", str(good), str(stale)]) == 1
    assert "stale.yaml is out of date with the models: run `make crds`" in capsys.readouterr().err


def schema() -> dict[str, Any]:
    doc = yaml.safe_load(crd.render())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        out += walk(child, f"{path}.{name}")
    if "items" in node:
        out += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    for path, node in walk(schema()):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs", "const"):
            assert banned not in node, f"{path} has {banned}"
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, f"{path}: properties + additionalProperties"
        if node.get("type") == "object" and "properties" not in node:
            open_ = node.get("x-kubernetes-preserve-unknown-fields") or isinstance(
                node.get("additionalProperties"), dict
            )
            assert open_ or path == ".metadata", f"{path}: an object with no fields would be pruned"


def test_every_spec_and_status_field_has_a_description_for_kubectl_explain() -> None:
    for path, node in walk(schema()):
        if path.startswith((".spec", ".status")) and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description"


def test_pod_template_is_open_but_its_containers_are_required() -> None:
    worker = schema()["properties"]["spec"]["properties"]["replicaSpecs"]["properties"]["Worker"]
    template = worker["properties"]["template"]
    assert template["type"] == "object"
    assert template["x-kubernetes-preserve-unknown-fields"] is True
    pod_spec = template["properties"]["spec"]
    assert pod_spec["required"] == ["containers"]
    assert pod_spec["properties"]["containers"]["minItems"] == 1
    assert worker["required"] == ["template"]


def test_cel_rules_carry_the_models_messages() -> None:
    rules = schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert [(r["rule"], r["message"]) for r in rules] == [
        (r.cel, r.message) for r in models.SPEC_RULES
    ]
    name_rules = schema()["properties"]["metadata"]["properties"]["name"]
    assert [r["message"] for r in name_rules["x-kubernetes-validations"]] == [
        message for _, message in models.NAME_RULES
    ]


def lookup(path: str) -> dict[str, Any]:
    node = schema()
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_scale_subresource_and_printer_columns_point_at_real_fields() -> None:
    version = yaml.safe_load(crd.render())["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert lookup(scale["specReplicasPath"])["type"] == "integer"
    assert lookup(scale["statusReplicasPath"])["type"] == "integer"
    assert lookup(scale["labelSelectorPath"])["type"] == "string"
    assert version["subresources"]["status"] == {}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == [
        "Min",
        "Max",
        "Desired",
        "Active",
        "Step",
        "Phase",
        "Age",
        "Admitted",  # -o wide only
        "Placement",  # -o wide only
        "Goodput",  # -o wide only
    ]
    for name, path in columns.items():
        if name != "Age":
            lookup(path)


def test_names_and_group_are_the_archived_controllers() -> None:
    doc = yaml.safe_load(crd.render())
    assert doc["metadata"]["name"] == "elasticjobs.elastic.pytorch.org"
    assert doc["spec"]["names"]["kind"] == "ElasticJob"
    assert doc["spec"]["versions"][0]["name"] == "v1alpha1"
    assert "ej" in doc["spec"]["names"]["shortNames"]
