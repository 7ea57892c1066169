# Two images from one tree:
#   docker build --target operator -t elasticjob-operator .   # kopf operator, no torch
#   docker build --target runtime  -t elasticjob-runtime  .   # torch + the trainer runtime
# `make images` builds both here (images/build.sh): on a local base image where no
# registry is reachable, with the machine's CA for pip as a build secret.
#
# Build arguments:
#   PYTHON_IMAGE          the base (python3 3.11 on Debian bookworm)
#   PIP_INDEX_URL         another package index (a mirror)
#   PIP_EXTRA_INDEX_URL   an extra one, e.g. https://download.pytorch.org/whl/cpu for
#                         CPU-only torch wheels (PyPI's are CUDA builds of several GB)
# Build secret `ca` (optional): a CA bundle pip trusts while building (a proxy's CA); it
# is mounted for the pip steps only and is in no layer of either image.
#
# Layers: the dependencies first (from pyproject.toml and constraints.txt only), then the
# code with --no-deps, so a code change rebuilds in seconds.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install -U pip setuptools wheel
WORKDIR /src
COPY pyproject.toml constraints.txt ./
# the requirements of one extra, read from pyproject.toml (no code needed yet)
RUN printf '%s\n' \
      'import sys, tomllib' \
      'project = tomllib.load(open("pyproject.toml", "rb"))["project"]' \
      'print("\n".join(project["dependencies"] + project["optional-dependencies"][sys.argv[1]]))' \
      > /tmp/requirements.py

FROM base AS operator-build
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 /tmp/requirements.py operator > /tmp/requirements.txt \
 && /opt/venv/bin/pip install -c constraints.txt -r /tmp/requirements.txt
COPY README.md ./
COPY operator ./operator
COPY trainer-runtime ./trainer-runtime
COPY devcluster/elasticjob_devcluster ./devcluster/elasticjob_devcluster
COPY examples ./examples
# the kubernetes package's asyncio copy (68 MB) is never imported, and the operator
# installs nothing at run time: without them and pip the image is a third smaller
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation . \
 && rm -rf /opt/venv/lib/python3.*/site-packages/kubernetes/aio \
 && /opt/venv/bin/pip uninstall -y -q pip setuptools wheel \
 && python -c "import elasticjob_operator.handlers, sys; assert not {'torch', 'grpc'} & set(sys.modules)"

FROM base AS runtime-build
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 /tmp/requirements.py runtime > /tmp/requirements.txt \
 && /opt/venv/bin/pip install -c constraints.txt -r /tmp/requirements.txt
COPY README.md ./
COPY operator ./operator
COPY trainer-runtime ./trainer-runtime
COPY devcluster/elasticjob_devcluster ./devcluster/elasticjob_devcluster
COPY examples ./examples
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation . \
 && python -c "import elasticjob_runtime.launcher, torch"

FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="elasticjob-operator" \
      org.opencontainers.image.description="ElasticJob operator (kopf); no torch"
ENV PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY --from=operator-build /opt/venv /opt/venv
# a name for the uid: kopf asks the system who it runs as (getpass), which fails for a
# uid without one
RUN groupadd --gid 65532 elasticjob \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin elasticjob
USER 65532:65532
EXPOSE 8080 8000
ENTRYPOINT ["kopf", "run", "--standalone", "-m", "elasticjob_operator.handlers"]
CMD ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="elasticjob-runtime" \
      org.opencontainers.image.description="PyTorch elastic trainer runtime (elasticjob-run, etcd-v3 rendezvous)"
ENV PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    HOME=/home/trainer
COPY --from=runtime-build /opt/venv /opt/venv
RUN groupadd --gid 65532 trainer \
 && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/trainer trainer
WORKDIR /home/trainer
USER 65532:65532
ENTRYPOINT ["elasticjob-run"]
