"""bench.soak's pure parts: which fault comes next, and what a job's logs say."""

from __future__ import annotations

import random

from bench.soak import (
    FaultKind,
    SoakConfig,
    Target,
    changes,
    choose_fault,
    job_manifest,
    result_of,
)

CFG = SoakConfig(seed=1, max_workers=3, node_losses=1)
TRAINING = Target("soak-00", 2, {"soak-00-worker-0": "node-1", "soak-00-worker-1": "node-2"})


def test_nothing_training_means_no_fault() -> None:
    assert choose_fault(random.Random(1), [], CFG, set(), 0) is None


def test_the_same_seed_chooses_the_same_faults() -> None:
    def draw(seed: int) -> list[object]:
        rng = random.Random(seed)
        return [choose_fault(rng, [TRAINING], CFG, set(), 0) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_every_kind_is_drawn_and_each_names_something_that_exists() -> None:
    rng = random.Random(3)
    drawn = [choose_fault(rng, [TRAINING], CFG, set(), 0) for _ in range(200)]
    assert {f.kind for f in drawn if f} == set(FaultKind)
    for f in drawn:
        assert f is not None and f.job == "soak-00"
        if f.kind in (FaultKind.KILL_WORKER, FaultKind.DELETE_POD):
            assert f.pod in TRAINING.pods
        if f.kind == FaultKind.SCALE:
            assert f.replicas in (1, 3)  # another size within [1, max]
        if f.kind == FaultKind.LOSE_NODE:
            assert f.node in ("node-1", "node-2")


def test_no_node_is_lost_past_the_bound_nor_the_spared_one() -> None:
    rng = random.Random(5)
    used_up = [choose_fault(rng, [TRAINING], CFG, set(), 1) for _ in range(100)]
    assert all(f is not None and f.kind != FaultKind.LOSE_NODE for f in used_up)
    spared = [choose_fault(rng, [TRAINING], CFG, {"node-1"}, 0) for _ in range(100)]
    lost = {f.node for f in spared if f is not None and f.kind == FaultKind.LOSE_NODE}
    assert lost == {"node-2"}


def test_result_and_world_changes_are_read_from_the_lines() -> None:
    lines = ["step=10 world=2", 'ELASTICJOB_RESULT {"steps": 300}', "bye"]
    assert result_of(lines) == {"steps": 300}
    assert result_of(["ELASTICJOB_RESULT {torn"]) == {}
    assert changes([2, 2, 3, 3, 1, 1, 2]) == [2, 3, 1, 2]


def test_a_job_runs_the_image_the_config_names_or_else_the_examples() -> None:
    def image(cfg: SoakConfig) -> str:
        spec = job_manifest("soak-00", cfg)["spec"]["replicaSpecs"]["Worker"]["template"]
        return str(spec["spec"]["containers"][0]["image"])

    assert image(SoakConfig(seed=1, image="elasticjob-runtime:e2e")) == "elasticjob-runtime:e2e"
    assert image(SoakConfig(seed=1)) == "ghcr.io/elasticjob/elasticjob-runtime:0.1.0"
