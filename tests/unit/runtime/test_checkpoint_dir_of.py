"""Where a Run checkpoints (run.checkpoint_dir_of): the manifest's volume, not the pod's /tmp."""

from __future__ import annotations

from pathlib import Path

from elasticjob_runtime.training.run import checkpoint_dir_of

ENV = {"ELASTICJOB_CHECKPOINT_DIR": "/checkpoints"}


def test_the_scripts_own_directory_wins() -> None:
    assert checkpoint_dir_of("/mine", ENV) == Path("/mine")


def test_without_one_the_manifests_variable_is_used() -> None:
    assert checkpoint_dir_of(None, ENV) == Path("/checkpoints")
    assert checkpoint_dir_of("", ENV) == Path("/checkpoints")


def test_without_either_it_is_left_to_the_temp_dir() -> None:
    assert checkpoint_dir_of(None, {}) is None
    assert checkpoint_dir_of(None, {"ELASTICJOB_CHECKPOINT_DIR": ""}) is None
