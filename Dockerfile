# syntax=docker/dockerfile:1
# Two images from one tree:
#   docker build --target operator -t elasticjob-operator .   # kopf operator, no torch
#   docker build --target runtime  -t elasticjob-runtime  .   # torch + the trainer runtime
# The pip lines are the ones CI runs (scripts/bootstrap.sh), with the extra of each image
# instead of [dev] and a regular (not editable) install.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install -U pip setuptools wheel
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY trainer-runtime ./trainer-runtime
COPY devcluster/elasticjob_devcluster ./devcluster/elasticjob_devcluster
COPY examples ./examples

FROM base AS operator-build
RUN /opt/venv/bin/pip install -c constraints.txt ".[operator]" \
 && python -c "import elasticjob_operator.handlers, sys; assert not {'torch', 'grpc'} & set(sys.modules)"

FROM base AS runtime-build
RUN /opt/venv/bin/pip install -c constraints.txt ".[runtime]"

FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="elasticjob-operator" \
      org.opencontainers.image.description="ElasticJob operator (kopf); no torch"
ENV PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
COPY --from=operator-build /opt/venv /opt/venv
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
