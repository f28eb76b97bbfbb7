# rota's image: the orchestrator (with its etcd store and the pod controller) and the node agent.
#
#   rota k8s image --build          # or: docker build -t rota:0.1.0 .
#   docker tag rota:0.1.0 REGISTRY/rota:0.1.0 && docker push REGISTRY/rota:0.1.0
#   rota k8s render --image REGISTRY/rota:0.1.0 | kubectl apply -f -
#
# Two stages: the build stage installs rota's packages from this repository, with the
# dependency versions image.lock pins, into a virtual environment; the final stage is the
# same pinned Python with only that environment, run as a non-root user (the agent's pod
# overrides it: see rota_k8s).
ARG PYTHON_VERSION=3.11.11
ARG DEBIAN=bookworm

FROM python:${PYTHON_VERSION}-slim-${DEBIAN} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY packages/core packages/core
COPY packages/agent-client packages/agent-client
COPY packages/agent packages/agent
COPY packages/orchestrator-etcd packages/orchestrator-etcd
COPY packages/k8s-controller packages/k8s-controller
# image.lock pins every third-party distribution (scripts/lock_image.py writes it): a rebuild
# installs what was tested, not whatever is newest that day.
COPY image.lock image.lock
RUN python -m venv /opt/rota \
 && /opt/rota/bin/pip install -c image.lock ./packages/core ./packages/agent-client "./packages/agent[gpu]" \
        ./packages/orchestrator-etcd ./packages/k8s-controller \
 && /opt/rota/bin/pip check \
 && /opt/rota/bin/rota --version

FROM python:${PYTHON_VERSION}-slim-${DEBIAN}
LABEL org.opencontainers.image.title="rota" \
      org.opencontainers.image.description="Co-operative GPU time-slicing: orchestrator, controller, node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/rota /opt/rota
ENV PATH=/opt/rota/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# 65532: the uid the rendered pods run as (runAsNonRoot, read-only root filesystem).
USER 65532:65532
WORKDIR /tmp
CMD ["rota", "--help"]
