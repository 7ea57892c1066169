#!/usr/bin/env bash
# Builds the pinned Kueue manager (see kueue/go.mod) into a cache outside the repo, once
# per version, and keeps that version's CRDs and Helm chart beside it: the devcluster
# starts the binary and applies the CRDs, kind installs the chart with an image of it.
# Usage: devcluster/build-kueue.sh  -> prints the directory (kueue, crds/, chart/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}
version=$(awk '$1=="sigs.k8s.io/kueue" && $2 ~ /^v/ {print $2}' "$here/kueue/go.mod")
out="$cache/bin/kueue-$version"
if [[ -x "$out/kueue" && -d "$out/crds" && -d "$out/chart" ]]; then
  echo "$out"; exit 0
fi
mkdir -p "$out"
cd "$here/kueue"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
echo "building kueue $version into $out (first time: several minutes on 2 cores)" >&2
pkg=sigs.k8s.io/kueue/pkg/version
go build -trimpath -ldflags "-s -w -X $pkg.GitVersion=$version" -o "$out/kueue.tmp" sigs.k8s.io/kueue/cmd/kueue
src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
rm -rf "$out/crds" "$out/chart"
cp -r "$src/config/components/crd/bases" "$out/crds"
cp -r "$src/charts/kueue" "$out/chart"
chmod -R u+w "$out/crds" "$out/chart"
mv "$out/kueue.tmp" "$out/kueue"
echo "$out"
