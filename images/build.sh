#!/usr/bin/env bash
# `make images`: both Dockerfile targets, built here with no registry reachable.
#
# A Docker engine (images/engine.sh: the one running, or ours), a local Python base
# image (images/base-image.sh, from debootstrap), then
#   elasticjob-operator:$IMAGE_TAG  and  elasticjob-runtime:$IMAGE_TAG
# built with --build-arg PYTHON_IMAGE=<that base> and, if this machine's HTTPS goes
# through a proxy with its own CA, that CA as the build secret `ca` (never in a layer).
# Prints each image's size. Elsewhere the Dockerfile builds as is, on python:3.11-slim.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
tag="${IMAGE_TAG:-dev}"
ca="${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

DOCKER_HOST="$("$repo/images/engine.sh" up)"
export DOCKER_HOST DOCKER_BUILDKIT=1
base="$("$repo/images/base-image.sh")"

docker=("$("$repo/images/engine.sh" builder)")  # BuildKit: the `ca` secret needs it

args=(--network host --build-arg "PYTHON_IMAGE=$base")
[[ -n "${PIP_INDEX_URL:-}" ]] && args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
[[ -n "${PIP_EXTRA_INDEX_URL:-}" ]] && args+=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
[[ -s "$ca" ]] && args+=(--secret "id=ca,src=$ca")

for target in ${TARGETS:-operator runtime}; do
  image="elasticjob-$target:$tag"
  echo "[images] building $image" >&2
  start=$(date +%s)
  "${docker[@]}" build "${args[@]}" --target "$target" -t "$image" "$repo" >&2
  size=$(docker image inspect --format '{{.Size}}' "$image")
  echo "[images] $image: $((size / 1024 / 1024)) MiB, built in $(( $(date +%s) - start )) s" >&2
done
# Each rebuild leaves its predecessor untagged and its layers in the build cache: over
# sessions the engine's data (~/.cache/elasticjob/docker) reached 42 GB and a kind image
# load ran out of disk. Keep the cache bounded and drop the untagged images.
"${docker[@]}" builder prune -f --keep-storage 8GB >/dev/null 2>&1 || true
docker image prune -f >/dev/null 2>&1 || true
echo "DOCKER_HOST=$DOCKER_HOST"
