"""The runtime's public face: what a training script imports from ``elasticjob_runtime``.

It must load nothing heavy until a name is used (the operator imports the package for
``contract``), and every name it promises must exist and be the runtime's own object.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import elasticjob_runtime


def test_importing_the_package_imports_neither_torch_nor_kopf_nor_kubernetes() -> None:
    code = (
        "import json, sys, elasticjob_runtime, elasticjob_runtime.contract\n"
        "print(json.dumps(sorted(m for m in ('torch', 'kopf', 'kubernetes') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("name", elasticjob_runtime.__all__)
def test_every_public_name_loads_the_runtimes_own_object(name: str) -> None:
    value = getattr(elasticjob_runtime, name)
    assert value.__module__.startswith("elasticjob_runtime.")
    assert value.__name__ == name
    assert name in dir(elasticjob_runtime)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="'NoSuchThing'"):
        _ = elasticjob_runtime.NoSuchThing  # type: ignore[attr-defined]


def test_the_public_names_are_the_ones_the_training_loop_docs_use() -> None:
    from elasticjob_runtime.training.run import Run
    from elasticjob_runtime.training.sampler import ElasticSampler

    assert elasticjob_runtime.Run is Run
    assert elasticjob_runtime.ElasticSampler is ElasticSampler
