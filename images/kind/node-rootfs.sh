#!/usr/bin/env bash
# The kind node's root filesystem, as a tarball for `docker import`: Debian bookworm from
# debootstrap with systemd (252: the last line of systemd that still boots on the cgroup
# v1 hosts here) and what kubelet and kube-proxy call on a node (iptables, ipset,
# conntrack, mount, ...; python3 for the runc wrapper; runc), plus containerd 1.7 from
# trixie (bookworm's 1.6 lacks the CRI calls kubelet 1.35 asks for first; trixie's runc
# needs a newer glibc, bookworm's serves). Cached: a second run prints the tarball's path
# and does nothing else.
#
#   images/kind/node-rootfs.sh    # prints the tarball's path
set -euo pipefail

cache="${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tarball="$cache/kind/node-rootfs.tar"
# from trixie, by exact version: the node image is the same wherever it is built
trixie_debs=(containerd=1.7.24~ds1-6+deb13u1)

say() { echo "[node-rootfs] $*" >&2; }

if [[ -f "$tarball" ]]; then echo "$tarball"; exit 0; fi
if ! command -v debootstrap >/dev/null; then
  [[ "$(id -u)" == 0 ]] || { say "debootstrap is missing: apt-get install debootstrap"; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >&2
fi

root="$(mktemp -d "${TMPDIR:-/tmp}/elasticjob-kind-rootfs.XXXXXX")"
trap 'rm -rf "$root"' EXIT
say "debootstrap bookworm into $root (from $mirror)"
debootstrap --variant=minbase \
  --include=systemd,systemd-sysv,dbus,iptables,ipset,conntrack,ethtool,socat,iproute2,mount,util-linux,kmod,procps,ca-certificates,libseccomp2,python3,runc \
  bookworm "$root" "$mirror" >&2

# containerd by name from trixie's package index; dpkg checks its dependencies against
# bookworm's (a Go program: it needs only runc).
index="$(mktemp)"
curl -fsSL "$mirror/dists/trixie/main/binary-amd64/Packages.gz" | gunzip >"$index"
for pin in "${trixie_debs[@]}"; do
  name="${pin%%=*}" version="${pin#*=}"
  file="$(awk -v n="$name" -v v="$version" '
    /^Package: / {p = $2} /^Version: / {ver = $2}
    /^Filename: / && p == n && ver == v {print $2; exit}' "$index")"
  [[ -n "$file" ]] || { say "trixie has no $name $version any more: update trixie_debs"; exit 1; }
  say "trixie: $name $version"
  curl -fsSL -o "$root/tmp/$name.deb" "$mirror/$file"
done
rm -f "$index"
chroot "$root" dpkg -i /tmp/containerd.deb >&2
rm -f "$root"/tmp/*.deb

# A node, not a system someone logs into: no getty, no units that wait for hardware
for unit in getty.target systemd-logind.service apt-daily.timer apt-daily-upgrade.timer \
    e2scrub_all.timer fstrim.timer systemd-timesyncd.service; do
  chroot "$root" systemctl mask "$unit" >&2 2>/dev/null || true
done
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/etc/machine-id
touch "$root/etc/machine-id"

mkdir -p "$(dirname "$tarball")"
tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
mv "$tarball.tmp" "$tarball"
echo "$tarball"
