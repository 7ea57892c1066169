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
# code with --no-deps, so a code change rebuilds in seconds. Each image carries them as two
# layers: the venv with the dependencies (torch: several GB, changed only when they
# change) and our code in /opt/elasticjob (under a MB, on the venv's path through a .pth
# file), so a code change pushes, pulls and loads only the small one.

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

FROM base AS operator-deps
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 /tmp/requirements.py operator > /tmp/requirements.txt \
 && /opt/venv/bin/pip install -c constraints.txt -r /tmp/requirements.txt
# the kubernetes package's asyncio copy (68 MB) is never imported
RUN rm -rf /opt/venv/lib/python3.*/site-packages/kubernetes/aio
# our code, installed in the next stage, goes on the venv's path
RUN echo /opt/elasticjob > "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/elasticjob.pth"

FROM operator-deps AS operator-build
COPY README.md ./
COPY operator ./operator
COPY trainer-runtime ./trainer-runtime
COPY devcluster/elasticjob_devcluster ./devcluster/elasticjob_devcluster
COPY pki ./pki
COPY examples ./examples
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation --target /opt/elasticjob . \
 && python -c "import elasticjob_operator.handlers, sys; assert not {'torch', 'grpc'} & set(sys.modules)"

# the operator installs nothing at run time: without pip its image is smaller
FROM operator-deps AS operator-venv
RUN /opt/venv/bin/pip uninstall -y -q pip setuptools wheel

FROM base AS runtime-deps
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 /tmp/requirements.py runtime > /tmp/requirements.txt \
 && /opt/venv/bin/pip install -c constraints.txt -r /tmp/requirements.txt
RUN echo /opt/elasticjob > "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/elasticjob.pth"

FROM runtime-deps AS runtime-build
COPY README.md ./
COPY operator ./operator
COPY trainer-runtime ./trainer-runtime
COPY devcluster/elasticjob_devcluster ./devcluster/elasticjob_devcluster
COPY pki ./pki
COPY examples ./examples
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation --target /opt/elasticjob . \
 && python -c "import elasticjob_runtime.launch.launcher, torch"

FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="elasticjob-operator" \
      org.opencontainers.image.description="ElasticJob operator (kopf); no torch"
ENV PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/elasticjob/bin:/opt/venv/bin:$PATH
COPY --from=operator-venv /opt/venv /opt/venv
COPY --from=operator-build /opt/elasticjob /opt/elasticjob
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
ENV PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/elasticjob/bin:/opt/venv/bin:$PATH \
    HOME=/home/trainer
COPY --from=runtime-deps /opt/venv /opt/venv
COPY --from=runtime-build /opt/elasticjob /opt/elasticjob
RUN groupadd --gid 65532 trainer \
 && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/trainer trainer
WORKDIR /home/trainer
USER 65532:65532
ENTRYPOINT ["elasticjob-run"]
