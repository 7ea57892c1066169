#!/usr/bin/env bash
# `make kind-e2e`: the e2e suites (tests/e2e) against a kind cluster instead of the
# devcluster. Builds the Dockerfile's two images, creates a kind cluster, loads the
# images into it, and runs pytest with the cluster's kubeconfig; each suite helm-installs
# the chart itself with these images (ELASTICJOB_E2E_HELM_ARGS), exactly as it does on the
# devcluster. Needs docker, kind, kubectl and helm on PATH. The cluster is deleted at the
# end unless KEEP_CLUSTER=1.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
cluster="${KIND_CLUSTER:-elasticjob-e2e}"
tag="${IMAGE_TAG:-e2e}"
operator_image="elasticjob-operator:${tag}"
runtime_image="elasticjob-runtime:${tag}"
kubeconfig="$(mktemp "${TMPDIR:-/tmp}/kind-e2e-kubeconfig.XXXXXX")"

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind-e2e: $tool is not on PATH; install it first" >&2; exit 1; }
done

cleanup() {
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; fi
  rm -f "$kubeconfig"
}
trap cleanup EXIT

docker build --target operator -t "$operator_image" "$repo"
docker build --target runtime -t "$runtime_image" "$repo"
kind create cluster --name "$cluster" --kubeconfig "$kubeconfig" --wait 180s
kind load docker-image --name "$cluster" "$operator_image" "$runtime_image"

export ELASTICJOB_E2E_KUBECONFIG="$kubeconfig"
export ELASTICJOB_E2E_RUNTIME_IMAGE="$runtime_image"
export ELASTICJOB_E2E_HELM_ARGS="--set image.repository=elasticjob-operator --set image.tag=${tag} --set image.pullPolicy=Never"
cd "$repo"
"$repo/scripts/pytest-strict" tests/e2e -m e2e "$@"
