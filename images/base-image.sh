#!/usr/bin/env bash
# The Python base image the Dockerfile builds FROM where no registry is reachable:
# Debian bookworm (python3 3.11, as python:3.11-slim-bookworm) from debootstrap, imported
# with `docker import`. The root filesystem's tarball is cached, so a second run only
# imports it (or does nothing if the image exists).
#
#   DOCKER_HOST=... images/base-image.sh   # prints the image name
set -euo pipefail

cache="${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}"
image="${BASE_IMAGE:-elasticjob-python:3.11-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tarball="$cache/images/python3.11-bookworm.tar"

say() { echo "[base-image] $*" >&2; }

if docker image inspect "$image" >/dev/null 2>&1; then echo "$image"; exit 0; fi
if [[ ! -f "$tarball" ]]; then
  if ! command -v debootstrap >/dev/null; then
    [[ "$(id -u)" == 0 ]] || { say "debootstrap is missing: apt-get install debootstrap"; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >&2
  fi
  root="$(mktemp -d "${TMPDIR:-/tmp}/elasticjob-rootfs.XXXXXX")"
  trap 'rm -rf "$root"' EXIT
  say "debootstrap bookworm into $root (from $mirror)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror" >&2
  # an image, not a system: no apt lists, caches or docs
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/*
  mkdir -p "$(dirname "$tarball")"
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
say "importing $tarball as $image"
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tarball" "$image" >&2
echo "$image"
