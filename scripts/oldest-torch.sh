#!/usr/bin/env bash
# The oldest torch the runtime supports, tested beside the newest (constraints.txt's).
#
#   scripts/oldest-torch.sh setup   a second venv in the cache (ELASTICJOB_CACHE) with
#                                   torch $OLDEST_TORCH alone; everything else (the project,
#                                   pytest, numpy, the CUDA libraries torch loads at import)
#                                   comes from the main venv through a .pth file, so only
#                                   torch differs and only its wheel is downloaded (0.5 GB)
#   scripts/oldest-torch.sh test    setup, then the tests that lean on torch the most: the
#                                   fence around its private names and the in-place
#                                   recovery tests (DDP, FSDP2, HSDP) on that torch
#
# pyproject.toml's `torch>=` floor is this version (tests/unit/test_torch_range.py).
set -euo pipefail
OLDEST_TORCH=2.11.0
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${ELASTICJOB_CACHE:-$HOME/.cache/elasticjob}
main="$cache/venv"
venv="$cache/venv-torch-$OLDEST_TORCH"
log() { echo "[oldest-torch] $*" >&2; }

setup() {
  [[ -x "$main/bin/python" ]] || { log "no venv at $main: run make setup first"; exit 1; }
  local site main_site
  main_site=$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv $venv"
    python3 -m venv "$venv"
  fi
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # after this venv's own site-packages, so its torch is the one imported
  echo "import site; site.addsitedir('$main_site')" > "$site/zz-elasticjob-main-venv.pth"
  # pytest too, for a `pytest` on PATH that runs this venv's Python (installed here even
  # though the main venv's is visible, or pip would take that one as installed)
  local want
  want="torch==$OLDEST_TORCH pytest==$("$main/bin/python" -c 'import pytest; print(pytest.__version__)')"
  if [[ "$(cat "$venv/.elasticjob-stamp" 2>/dev/null)" != "$want" ]]; then
    log "pip install $want (their wheels alone)"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --no-deps --ignore-installed $want
    echo "$want" > "$venv/.elasticjob-stamp"
  fi
  "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$OLDEST_TORCH')" || {
    log "$venv does not import torch $OLDEST_TORCH"
    exit 1
  }
}

TESTS=(
  tests/unit/runtime/test_torch_internals.py
  tests/integration/recovery/test_in_place.py
  "tests/integration/recovery/test_fsdp_in_place.py::test_an_fsdp_join_moves_the_shards_in_memory_and_trains_what_a_dcp_reshard_trains"
  "tests/integration/recovery/test_fsdp_in_place.py::test_fsdp_at_world_2_trains_what_one_process_trains_on_the_same_global_batch"
  "tests/integration/recovery/test_hsdp_in_place.py::test_a_killed_hsdp_worker_costs_no_step_and_hsdp_trains_what_one_process_trains"
)

case "${1:-}" in
  setup) setup ;;
  test)
    setup
    cd "$repo"
    log "torch $OLDEST_TORCH: ${#TESTS[@]} test files and tests"
    PATH="$venv/bin:$PATH" "$repo/scripts/pytest-strict" -p no:cacheprovider "${TESTS[@]}" "${@:2}"
    ;;
  *) echo "usage: scripts/oldest-torch.sh setup | test [pytest args]" >&2; exit 2 ;;
esac
