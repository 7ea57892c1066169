"""The images the devcluster can run, and kubelet's image step as far as it has one. Pure.

The devcluster pulls nothing: a container runs its `command` from this repo's Python
environment. A container with no `command` runs its image's ENTRYPOINT on a real node
(with its `args`, or else the image's CMD), so for the project's own images, whose
ENTRYPOINT and CMD the Dockerfile fixes, the devcluster uses those: a manifest written
for the archived TorchElastic controller (the runtime image and only `args`) runs as it
would on a node. `tests/unit/devcluster/test_container_images.py` holds `KNOWN` to the Dockerfile.
The image's WORKDIR, USER and ENV are not applied: every container starts in `/` (or
its `workingDir`) with the pod's env, as the devcluster's containers do.

What kubelet reports when this step fails, the container waiting meanwhile:
`InvalidImageName` for a reference that does not parse (any container), `ErrImagePull`
for an image whose entrypoint is needed and unknown, then `ImagePullBackOff` while it
retries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

Obj = dict[str, Any]

INVALID_IMAGE_NAME: Final = "InvalidImageName"
ERR_IMAGE_PULL: Final = "ErrImagePull"
IMAGE_PULL_BACKOFF: Final = "ImagePullBackOff"


@dataclass(frozen=True)
class Image:
    """What an image runs when the container does not say: ENTRYPOINT and CMD."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()


# By repository name (the reference's last path component), whatever the registry and
# tag: `ghcr.io/elasticjob/elasticjob-runtime:0.1.0`, `elasticjob-runtime:dev`, yours.
KNOWN: Final = {
    "elasticjob-runtime": Image(("elasticjob-run",)),
    "elasticjob-operator": Image(
        ("kopf", "run", "--standalone", "-m", "elasticjob_operator.handlers"),
        ("--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"),
    ),
}


class ImageError(Exception):
    """The image step failed: kubelet's waiting reason and message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# distribution/reference's grammar, which kubelet parses image references with
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(rf"({_NAME})(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
_MAX_NAME = 255


def repository(ref: str) -> str:
    """The repository name of an image reference (`elasticjob-runtime` of
    `ghcr.io/elasticjob/elasticjob-runtime:0.1.0`); InvalidImageName if it does not parse."""
    m = _REFERENCE.fullmatch(ref)
    if m is None or len(m.group(1)) > _MAX_NAME:
        raise ImageError(
            INVALID_IMAGE_NAME,
            f'Failed to apply default image tag "{ref}": couldn\'t parse image name '
            f'"{ref}": invalid reference format',
        )
    return m.group(1).rsplit("/", 1)[-1]


def pull(container: Obj) -> Image | None:
    """Kubelet's image step for `container`: its image's ENTRYPOINT and CMD when it has no
    command (None: its command is all that runs). Raises ImageError."""
    ref = str(container.get("image") or "")
    name = repository(ref)
    if container.get("command"):
        return None
    image = KNOWN.get(name)
    if image is None:
        known = " and ".join(sorted(KNOWN))
        raise ImageError(
            ERR_IMAGE_PULL,
            f"the devcluster pulls no images and knows the ENTRYPOINT of {known} only: "
            f'image "{ref}" needs a command in container "{container.get("name")}"',
        )
    return image


def after_failure(previous: str, error: ImageError, ref: str) -> tuple[str, str]:
    """The waiting reason and message after a failed image step, given the previous
    reason: a pull that failed before is backing off (ImagePullBackOff)."""
    if error.reason == ERR_IMAGE_PULL and previous in (ERR_IMAGE_PULL, IMAGE_PULL_BACKOFF):
        return IMAGE_PULL_BACKOFF, f'Back-off pulling image "{ref}"'
    return error.reason, error.message
