"""Kubelet's image step on the devcluster: references parse as kubelet parses them, the
project's own images run their Dockerfile ENTRYPOINT, an unknown one fails to pull."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elasticjob_devcluster.container_images import (
    ERR_IMAGE_PULL,
    IMAGE_PULL_BACKOFF,
    INVALID_IMAGE_NAME,
    KNOWN,
    Image,
    ImageError,
    after_failure,
    pull,
    repository,
)

DOCKERFILE = Path(__file__).resolve().parents[3] / "Dockerfile"


@pytest.mark.parametrize(
    ("ref", "name"),
    [
        ("ghcr.io/elasticjob/elasticjob-runtime:0.1.0", "elasticjob-runtime"),
        ("registry.example.com:5000/ml/elasticjob-runtime", "elasticjob-runtime"),
        ("elasticjob-runtime:dev", "elasticjob-runtime"),
        ("quay.io/coreos/etcd:v3.6.16", "etcd"),
        ("torchelastic/examples:0.2.0", "examples"),
        ("busybox@sha256:" + "a" * 64, "busybox"),
        ("localhost/a__b.c-d:Tag_1", "a__b.c-d"),
        ("[::1]:5000/x:y", "x"),
    ],
)
def test_a_reference_names_its_repository(ref: str, name: str) -> None:
    assert repository(ref) == name


@pytest.mark.parametrize(
    "ref",
    ["", "Ab", "ml/Trainer", "a::b", "a:", ":tag", "a b", "a/", "-a", "a:" + "t" * 129, "ӕ"],
)
def test_a_reference_that_does_not_parse_is_invalid_image_name(ref: str) -> None:
    with pytest.raises(ImageError) as raised:
        repository(ref)
    assert raised.value.reason == INVALID_IMAGE_NAME
    assert "invalid reference format" in raised.value.message


def test_a_container_with_a_command_needs_no_image() -> None:
    assert pull({"name": "c", "image": "anything/at-all:1", "command": ["python"]}) is None
    with pytest.raises(ImageError, match="couldn't parse"):  # but it must still parse
        pull({"name": "c", "image": "Nope", "command": ["python"]})


def test_an_args_only_container_of_the_runtime_image_runs_its_entrypoint() -> None:
    c = {"name": "w", "image": "ghcr.io/elasticjob/elasticjob-runtime:0.1.0", "args": ["x.py"]}
    assert pull(c) == Image(("elasticjob-run",))


def test_an_image_whose_entrypoint_is_unknown_fails_to_pull_then_backs_off() -> None:
    c = {"name": "w", "image": "torchelastic/examples:0.2.0", "args": ["main.py"]}
    with pytest.raises(ImageError) as raised:
        pull(c)
    err = raised.value
    assert err.reason == ERR_IMAGE_PULL
    assert 'image "torchelastic/examples:0.2.0" needs a command in container "w"' in err.message
    first = after_failure("ContainerCreating", err, c["image"])
    assert first == (ERR_IMAGE_PULL, err.message)
    then = after_failure(first[0], err, c["image"])
    assert then == (IMAGE_PULL_BACKOFF, 'Back-off pulling image "torchelastic/examples:0.2.0"')
    assert after_failure(then[0], err, c["image"]) == then
    invalid = ImageError(INVALID_IMAGE_NAME, "bad")
    assert after_failure(IMAGE_PULL_BACKOFF, invalid, "Bad") == (INVALID_IMAGE_NAME, "bad")


def dockerfile_stage(target: str) -> dict[str, tuple[str, ...]]:
    """The ENTRYPOINT and CMD (JSON form) of one stage of the Dockerfile."""
    text = DOCKERFILE.read_text()
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)
    [stage] = [s for s in stages if re.match(rf"\S+ AS {target}\s*$", s.splitlines()[0])]
    found = {}
    for word in ("ENTRYPOINT", "CMD"):
        m = re.search(rf"^{word} (\[.*\])\s*$", stage, flags=re.MULTILINE)
        found[word] = tuple(json.loads(m.group(1))) if m else ()
    return found


@pytest.mark.parametrize(
    ("target", "name"),
    [("runtime", "elasticjob-runtime"), ("operator", "elasticjob-operator")],
)
def test_the_known_images_are_the_dockerfiles(target: str, name: str) -> None:
    stage = dockerfile_stage(target)
    assert KNOWN[name] == Image(stage["ENTRYPOINT"], stage["CMD"])
