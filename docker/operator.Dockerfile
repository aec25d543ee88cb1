# Pagoda operator image: kopf + the pagoda.operator package, no engine dependencies.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t pagoda/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
COPY operator ./operator
COPY node_agent ./node_agent
COPY kernels ./kernels
# The CRD the operator server-side applies at start (and `render` validates against).
COPY crds ./crds
ENV PAGODA_CRD_FILE=/app/crds/modeldeployment.yaml
# Only the operator extra (kopf, aiohttp) and the core (pyyaml): no torch, no engine dependencies.
RUN pip install ".[operator]"

RUN useradd --uid 1000 --no-create-home --shell /usr/sbin/nologin pagoda
USER 1000
EXPOSE 8080
ENTRYPOINT ["pagoda-operator"]
CMD ["--log-format", "json"]
