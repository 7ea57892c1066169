"""run.loader's keywords: a plain DataLoader's that the Run owns get a line saying why."""

from __future__ import annotations

import pytest

from elasticjob_runtime.training.loader_options import ACCEPTED, refused_option


def test_the_loaders_own_options_pass() -> None:
    assert refused_option(ACCEPTED) is None
    assert refused_option([]) is None


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("seed", "run.loader() takes no seed=: each sample is read under a seed from Run(seed="),
        ("shuffle", "ElasticSampler(len(dataset), shuffle=...)"),
        ("sampler", "from the ElasticSampler given to run.wrap/run.shard"),
        ("drop_last", "every sample is trained once per epoch"),
        ("shufle", "run.loader() takes no shufle=; its options are accumulate, num_workers"),
    ],
)
def test_an_option_the_run_owns_or_does_not_know_is_named_with_what_decides_it(
    name: str, says: str
) -> None:
    found = refused_option(["num_workers", name])
    assert found is not None and says in found, found
