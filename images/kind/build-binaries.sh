#!/usr/bin/env bash
# Every program in the kind node image, built here from the Go module proxy (no
# release downloads are reachable) into a cache directory, once per set of versions:
#   - kubelet, kubeadm, kube-proxy, kube-scheduler, at the Kubernetes version the
#     devcluster pins (devcluster/go/go.mod), beside its kube-apiserver,
#     kube-controller-manager and etcd (devcluster/build-binaries.sh);
#   - kind itself, crictl, the CNI plugins, kube-router (the network and its
#     NetworkPolicy) and CoreDNS, at the versions below;
#   - pause, our own (images/kind/pause.c), static.
#
#   images/kind/build-binaries.sh   # prints the bin directory
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}"

kind_version=v0.33.0
crictl_version=v1.34.0
cni_plugins_version=v1.9.1
kube_router_version=v2.1.0
coredns_version=v1.14.7

control_plane="$("$repo/devcluster/build-binaries.sh")"
k8s="$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2}' "$repo/devcluster/go/go.mod")"
bin="$cache/kind/bin-$k8s-kind-$kind_version-router-$kube_router_version-coredns-$coredns_version"
node_programs=(kubelet kubeadm kube-proxy kube-scheduler kind crictl kube-router coredns pause
  bridge host-local loopback portmap ptp)

complete() {
  local p
  for p in "${node_programs[@]}"; do [[ -x "$bin/$p" ]] || return 1; done
}
if complete; then echo "$bin"; exit 0; fi
mkdir -p "$bin"
say() { echo "[kind-binaries] $*" >&2; }

for p in kube-apiserver kube-controller-manager etcd; do ln -sf "$control_plane/$p" "$bin/$p"; done

# the same -X version stamps as the devcluster's build: kubeadm reads its own version
minor="$(echo "$k8s" | cut -d. -f2)"
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$k8s -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
for p in kubelet kubeadm kube-proxy kube-scheduler; do
  [[ -x "$bin/$p" ]] && continue
  say "building $p $k8s (first time: a few minutes each on 2 cores)"
  (cd "$repo/devcluster/go" && go build -trimpath -ldflags "$ldflags" -o "$bin/$p.tmp" "k8s.io/kubernetes/cmd/$p")
  mv "$bin/$p.tmp" "$bin/$p"
done

# Programs with a go.mod of their own: `go install module@version` honours it.
install() {
  local name="$1" package="$2"
  [[ -x "$bin/$name" ]] && return 0
  say "building $package"
  GOBIN="$bin/.install" go install -trimpath -ldflags "-s -w" "$package"
  mv "$bin/.install/$(basename "${package%@*}")" "$bin/$name"
}
install kind "sigs.k8s.io/kind@$kind_version"
install crictl "sigs.k8s.io/cri-tools/cmd/crictl@$crictl_version"
install kube-router "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$kube_router_version"
install coredns "github.com/coredns/coredns@$coredns_version"
for plugin in main/bridge main/loopback main/ptp meta/portmap ipam/host-local; do
  install "$(basename "$plugin")" "github.com/containernetworking/plugins/plugins/$plugin@$cni_plugins_version"
done
rmdir "$bin/.install" 2>/dev/null || true

if [[ ! -x "$bin/pause" ]]; then
  say "building pause"
  cc -static -Os -Wall -Wextra -Werror -o "$bin/pause" "$here/pause.c"
  strip "$bin/pause"
fi

complete || { say "missing from $bin: some of ${node_programs[*]}"; exit 1; }
echo "$bin"
