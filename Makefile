# elasticjob: `make demo` runs the main job, `make test` passes the tests.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CACHE ?= $(HOME)/.cache/elasticjob
export ELASTICJOB_CACHE := $(CACHE)
VENV := $(CACHE)/venv
export PATH := $(VENV)/bin:$(CACHE)/tools:$(PATH)
DEVCLUSTER_DIR := $(CURDIR)/.devcluster
PYTEST_ARGS ?=
SOAK_ARGS ?=

.PHONY: setup lint format test test-oldest-torch test-unit test-integration test-e2e cluster cluster-down crds demo bench soak kind-e2e test-kind images images-down test-images

setup:
	@scripts/bootstrap.sh

lint: setup
	ruff check .
	ruff format --check .
	mypy
	lint-imports

format: setup
	ruff check --fix .
	ruff format .

# Every suite runs but the images' (make test-images: it builds them first), in two
# pytests at once (scripts/pytest-suites says how they split); pytest's "no tests
# collected" (exit 5) is a failure, not a pass.
test: lint
	scripts/pytest-suites $(PYTEST_ARGS)

# the fence and the in-place recovery tests on the oldest torch supported (pyproject's
# floor), in a second venv; CI runs it after make test (about 3 minutes)
test-oldest-torch: setup
	scripts/oldest-torch.sh test $(PYTEST_ARGS)

test-unit: setup
	scripts/pytest-strict tests/unit $(PYTEST_ARGS)

test-integration: setup
	scripts/pytest-strict tests/integration $(PYTEST_ARGS)

test-e2e: setup
	scripts/pytest-strict tests/e2e $(PYTEST_ARGS)

# KUEUE=1 starts Kueue beside it (docs/scheduling.md)
cluster: setup
	elasticjob-devcluster up --dir $(DEVCLUSTER_DIR) $(if $(KUEUE),--kueue)

cluster-down:
	@if [ -x $(VENV)/bin/elasticjob-devcluster ]; then elasticjob-devcluster down --dir $(DEVCLUSTER_DIR); fi

crds: setup
	python -m elasticjob_operator.crd --write crds/elasticjob.yaml charts/elasticjob-operator/crds/elasticjob.yaml

demo: setup
	python scripts/demo.py

# BENCH_ARGS: bench.run's options, e.g. issue 36's table run (bench/README.md)
bench: setup
	python -m bench.run $(BENCH_ARGS)

# 20 jobs through 10 minutes of random faults; not part of `make test` (a smoke of it is).
soak: setup
	python -m bench.soak $(SOAK_ARGS)

# Both images, built here (images/build.sh): a Docker engine (ours if none runs), a local
# Python base image, then the Dockerfile's two targets. images-down stops our engine.
images:
	images/build.sh

images-down:
	images/engine.sh down

# The images run as a user runs them (tests/images): needs `make images` first.
test-images: setup
	scripts/pytest-strict tests/images $(PYTEST_ARGS)

# tests/e2e on a 3-node kind cluster built here (docs/kind.md); not in `make test` or CI:
# a fresh machine's CI run is already about an hour without it (README.md).
kind-e2e: setup
	scripts/kind-e2e.sh $(PYTEST_ARGS)

test-kind: kind-e2e
