#!/usr/bin/env bash
# A Docker engine for `make images` and the kind tests: the one DOCKER_HOST (or the
# default socket) names if it answers; otherwise our own dockerd, started by hand with
# everything under the cache (data, socket, pid file) and stopped by its recorded pid.
#
#   images/engine.sh up       # prints the DOCKER_HOST to use
#   images/engine.sh down     # stops our dockerd if we started one
#   images/engine.sh builder  # prints the docker client that builds with BuildKit
#
# Ours registers images/runc-wrapper.py as its default runtime: on hosts where root
# lacks CAP_SYS_RESOURCE, privileged containers (kind's nodes) fail in plain runc.
# docker.io is installed from Debian when dockerd is missing and we are root.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}"
dir="$cache/docker"
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"
ours="unix://$sock"

say() { echo "[engine] $*" >&2; }

running_pid() {
  [[ -f "$pidfile" ]] || return 1
  local pid
  pid="$(cat "$pidfile")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

up() {
  if [[ -n "${DOCKER_HOST:-}" && "$DOCKER_HOST" != "$ours" ]] && docker info >/dev/null 2>&1; then
    echo "$DOCKER_HOST"; return
  fi
  if [[ -z "${DOCKER_HOST:-}" ]] && docker info >/dev/null 2>&1; then
    echo "unix:///var/run/docker.sock"; return
  fi
  if running_pid >/dev/null && DOCKER_HOST="$ours" docker info >/dev/null 2>&1; then
    echo "$ours"; return
  fi
  if ! command -v dockerd >/dev/null; then
    if [[ "$(id -u)" != 0 ]]; then
      say "no Docker engine answers and dockerd is not installed: install Docker (e.g. apt-get install docker.io) or set DOCKER_HOST"
      exit 1
    fi
    say "installing docker.io from Debian"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io >&2
  fi
  mkdir -p "$dir"
  say "starting dockerd (data in $dir)"
  # cgroupfs: no systemd here; the wrapper keeps privileged containers working
  nohup dockerd \
    --host "$ours" \
    --data-root "$dir/data" \
    --exec-root "$dir/exec" \
    --pidfile "$pidfile" \
    --exec-opt native.cgroupdriver=cgroupfs \
    --add-runtime "elasticjob-runc=$repo/images/runc-wrapper.py" \
    --default-runtime elasticjob-runc \
    >"$dir/dockerd.log" 2>&1 &
  for _ in $(seq 1 120); do
    if DOCKER_HOST="$ours" docker info >/dev/null 2>&1; then echo "$ours"; return; fi
    sleep 0.5
  done
  say "dockerd did not answer within 60 s; its log: $dir/dockerd.log"
  tail -20 "$dir/dockerd.log" >&2
  exit 1
}

# dockerd leaves its bind mount of the host's network namespace under its exec root
unmount_leftovers() {
  local target
  for target in $(awk -v d="$dir/exec/" 'index($2, d) == 1 {print $2}' /proc/mounts); do
    umount "$target" 2>/dev/null || true
  done
}

down() {
  local pid
  if ! pid="$(running_pid)"; then unmount_leftovers; return 0; fi
  say "stopping dockerd (pid $pid)"
  kill -TERM "$pid"
  for _ in $(seq 1 60); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; unmount_leftovers; return 0; }
    sleep 0.5
  done
  say "dockerd (pid $pid) did not stop in 30 s: killing it"
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pidfile"
  unmount_leftovers
}

# BuildKit (build secrets need it): a client with the buildx plugin, or the engine's own
# 20.10 client from Debian's docker.io (BuildKit built in), as here where the docker on
# PATH is a newer client without buildx (which would fall back to the legacy builder)
builder() {
  if docker buildx version >/dev/null 2>&1; then
    command -v docker
  elif [[ -x /usr/bin/docker ]] && [[ "$(/usr/bin/docker version --format '{{.Client.Version}}' 2>/dev/null)" == 20.10* ]]; then
    echo /usr/bin/docker
  else
    say "docker build needs BuildKit: install the buildx plugin (docker-buildx)"
    exit 1
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  builder) builder ;;
  *) echo "usage: $0 up|down|builder" >&2; exit 2 ;;
esac
