#!/usr/bin/env bash
# Builds the pinned control-plane binaries (see go/go.mod) into a cache outside the
# repo, once per version: kube-apiserver, kube-controller-manager, etcd.
# Usage: devcluster/build-binaries.sh  -> prints the bin directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}
k8s=$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2}' "$here/go/go.mod")
etcd=$(awk '$1=="go.etcd.io/etcd/server/v3" && $2 ~ /^v/ {print $2}' "$here/go/go.mod")
bin="$cache/bin/k8s-$k8s-etcd-$etcd"
if [[ -x "$bin/kube-apiserver" && -x "$bin/kube-controller-manager" && -x "$bin/etcd" ]]; then
  echo "$bin"; exit 0
fi
mkdir -p "$bin"
minor=$(echo "$k8s" | cut -d. -f2)
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$k8s -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
cd "$here/go"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
echo "building kube-apiserver $k8s, kube-controller-manager $k8s, etcd $etcd into $bin (first time: ~20-30 min on 2 cores)" >&2
go build -trimpath -ldflags "$ldflags" -o "$bin/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
go build -trimpath -ldflags "$ldflags" -o "$bin/kube-controller-manager.tmp" k8s.io/kubernetes/cmd/kube-controller-manager
go build -trimpath -ldflags "-s -w" -o "$bin/etcd.tmp" go.etcd.io/etcd/server/v3
for b in kube-apiserver kube-controller-manager etcd; do mv "$bin/$b.tmp" "$bin/$b"; done
echo "$bin"
