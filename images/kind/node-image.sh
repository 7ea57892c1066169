#!/usr/bin/env bash
# A kind node image built with no registry reachable (kind's own `build node-image`
# pulls a base image and the cluster's images, so it cannot run here):
#
#   1. a root filesystem: Debian bookworm, systemd, containerd (node-rootfs.sh);
#   2. every program from the Go module proxy (build-binaries.sh);
#   3. the images kubeadm and the network run, each a small image around one of those
#      programs, saved into one tarball that the node imports at its first boot;
#   4. the node image: the root filesystem, the programs, node/ (entrypoint, units,
#      containerd's config, the CNI manifest kind applies) and that tarball.
#
# The image's tag is a hash of everything it is built from, so a second run prints
# the name and does nothing.
#
#   DOCKER_HOST=... images/kind/node-image.sh    # prints the node image's name
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}"
say() { echo "[node-image] $*" >&2; }

k8s="$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2}' "$repo/devcluster/go/go.mod")"
inputs="$( (cd "$repo" && find images/kind images/runc-wrapper.py devcluster/go devcluster/build-binaries.sh -type f -print0 |
  sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-12)"
image="elasticjob/kind-node:$k8s-$inputs"
if docker image inspect "$image" >/dev/null 2>&1; then echo "$image"; exit 0; fi

rootfs="$("$here/node-rootfs.sh")"
bin="$("$here/build-binaries.sh")"
rootfs_image="elasticjob/kind-node-rootfs:$(stat -c %Y "$rootfs")"
if ! docker image inspect "$rootfs_image" >/dev/null 2>&1; then
  say "importing $rootfs as $rootfs_image"
  docker import "$rootfs" "$rootfs_image" >/dev/null
fi

version_of() { "$bin/$1" "${@:2}" 2>/dev/null | grep -oE 'v?[0-9]+\.[0-9]+\.[0-9]+' | head -1; }
etcd_tag="$(version_of etcd --version)"
coredns_tag="v$(version_of coredns -version | sed 's/^v//')"
kube_router_tag="$(awk -F= '/^kube_router_version=/ {print $2}' "$here/build-binaries.sh")"
pause_tag="$(grep -oE 'pause:[0-9.]+' "$here/node/etc/containerd/config.toml" | cut -d: -f2)"

docker_build="$("$repo/images/engine.sh" builder) build"
ctx="$(mktemp -d "${TMPDIR:-/tmp}/elasticjob-kind-node.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
cp -L "$bin"/* "$ctx/"
# kind applies the CNI with kubectl inside the node: the one make setup pinned
cp "$cache/tools/kubectl" "$ctx/kubectl"

# One image per program, named as kubeadm and the manifests name them. The control
# plane, etcd, CoreDNS and pause are static programs alone in the image; kube-proxy and
# kube-router call iptables, ipset and ip, so they sit on the node's own filesystem.
preloaded=()
component() {
  local name="$1" program="$2" base="$3" path="$4"
  say "image $name"
  printf 'FROM %s\nCOPY %s %s\nENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin\nENTRYPOINT ["%s"]\n' \
    "$base" "$program" "$path" "$path" |
    $docker_build --quiet -t "$name" -f - "$ctx" >/dev/null
  preloaded+=("$name")
}
component "registry.k8s.io/kube-apiserver:$k8s" kube-apiserver scratch /usr/local/bin/kube-apiserver
component "registry.k8s.io/kube-controller-manager:$k8s" kube-controller-manager scratch /usr/local/bin/kube-controller-manager
component "registry.k8s.io/kube-scheduler:$k8s" kube-scheduler scratch /usr/local/bin/kube-scheduler
component "registry.k8s.io/etcd:$etcd_tag" etcd scratch /usr/local/bin/etcd
component "registry.k8s.io/coredns/coredns:$coredns_tag" coredns scratch /coredns
component "registry.k8s.io/pause:$pause_tag" pause scratch /pause
component "registry.k8s.io/kube-proxy:$k8s" kube-proxy "$rootfs_image" /usr/local/bin/kube-proxy
component "registry.k8s.io/kube-router:$kube_router_tag" kube-router "$rootfs_image" /usr/local/bin/kube-router
say "saving ${#preloaded[@]} images for the node to import"
docker save -o "$ctx/preloaded.tar" "${preloaded[@]}"

mkdir -p "$ctx/node"
cp -a "$here/node/." "$ctx/node/"
install -D -m 0755 "$repo/images/runc-wrapper.py" "$ctx/node/usr/local/sbin/elasticjob-runc"
echo "$k8s" >"$ctx/node/kind/version"
# the tags kubeadm must ask for instead of its defaults (read by kind-e2e's cluster config)
printf 'etcd=%s\ncoredns=%s\n' "$etcd_tag" "$coredns_tag" >"$ctx/node/kind/image-tags"

say "building $image"
$docker_build --quiet -t "$image" -f "$here/node.Dockerfile" --build-arg "ROOTFS=$rootfs_image" "$ctx" >/dev/null
echo "$image"
