# syntax=docker/dockerfile:1
#
# vidq video worker. Two targets:
#   worker      (default, last stage) GPU: the official PyTorch CUDA runtime image; its CUDA torch is kept as is.
#   worker-cpu  laptops and CI: python slim + the CPU build of torch; runs the `tiny-wan` model (renders noise).
#
#   docker build -f docker/worker.Dockerfile --target worker     -t vidq-worker .
#   docker build -f docker/worker.Dockerfile --target worker-cpu -t vidq-worker-cpu .
#
# Base images are pinned by tag; add @sha256 digests for fully reproducible builds. The CUDA base must carry a
# torch inside pyproject's range (torch>=2.4,<2.15) and a Python inside requires-python (>=3.11,<3.13).
ARG CUDA_TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
ARG TORCH_CPU_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

# ==== CPU variant =================================================================================================
FROM ${PYTHON_IMAGE} AS builder-cpu
ARG TORCH_CPU_VERSION
ARG TORCH_CPU_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app

# torch first, from PyTorch's CPU index: a plain `torch` requirement from PyPI pulls a multi-GB CUDA build.
# The constraint then keeps pip from swapping it while it resolves the `worker` extra.
RUN pip install --index-url "${TORCH_CPU_INDEX_URL}" "torch==${TORCH_CPU_VERSION}" \
    && echo "torch==${TORCH_CPU_VERSION}" > /opt/torch-constraint.txt

# Dependencies from pyproject.toml alone first (a cached layer until pyproject changes), then the code.
COPY pyproject.toml README.md ./
RUN pip install --constraint /opt/torch-constraint.txt ".[worker]"
COPY shared ./shared
COPY services ./services
COPY tools ./tools
COPY migrations ./migrations
# Editable ON PURPOSE: shared/infra/migrate.py finds migrations/ beside the packages, which a wheel does not carry;
# /app is copied to the same path in the runtime stage.
RUN pip install --no-deps -e . \
    && python -c "import torch; assert torch.version.cuda is None, 'expected the CPU build of torch'" \
    && vidq --help > /dev/null

FROM ${PYTHON_IMAGE} AS worker-cpu
LABEL org.opencontainers.image.title="vidq-worker-cpu" \
      org.opencontainers.image.description="vidq video worker, CPU build of torch, tiny-wan by default (renders noise)"

# Fixed numeric uid (Kubernetes runAsNonRoot checks it without resolving names). /models: model weights and the
# Hugging Face cache, a volume in compose, writable by the worker.
RUN groupadd --system --gid 10001 vidq \
    && useradd --system --uid 10001 --gid vidq --home-dir /home/vidq --create-home --shell /usr/sbin/nologin vidq \
    && mkdir -p /models && chown 10001:10001 /models

COPY --from=builder-cpu /opt/venv /opt/venv
COPY --from=builder-cpu /app /app

# tiny-wan: a real WanPipeline with tiny configs and random weights, so the whole path runs on any CPU in seconds.
# It renders noise. HF_HUB_OFFLINE: the worker never downloads at run time; mount weights under /models.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/models/huggingface \
    HF_HUB_OFFLINE=1 \
    VIDQ_DEVICE=cpu \
    VIDQ_DEFAULT_MODEL=tiny-wan

WORKDIR /app
USER 10001:10001
# The worker's Prometheus endpoint (VIDQ_WORKER_METRICS_PORT).
EXPOSE 9808

# The consumer loop touches VIDQ_WORKER_LIVENESS_FILE; a stale file means a stuck worker.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 CMD ["vidq", "worker-alive"]

# SIGTERM (Docker's default stop signal) is Celery's warm shutdown: the running job finishes first. Give the
# container a stop timeout longer than VIDQ_TASK_TIME_LIMIT_S (compose: stop_grace_period).
ENTRYPOINT ["vidq"]
CMD ["worker", "--role", "video", "--concurrency", "1"]

# ==== GPU variant =================================================================================================
FROM ${CUDA_TORCH_IMAGE} AS builder-gpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Keep the base image's CUDA build of torch: record it, and the NVIDIA CUDA/Triton wheels it came with (not the
# NVML bindings: the `worker` extra asks for those itself), as pip constraints, and build a venv that sees the
# base's site-packages. pip then only adds what the `worker` extra needs on top; if a dependency ever demanded
# another torch, resolution fails here instead of silently installing a CPU or different-CUDA torch.
# --without-pip: Ubuntu-based bases ship no ensurepip; the base's pip installs into the venv through --python.
RUN python3 -m pip list --format=freeze | grep -iE '^(torch|triton|nvidia-[a-z0-9-]+)==' \
        | grep -viE '^nvidia-ml-py==' > /opt/base-torch.txt \
    && cat /opt/base-torch.txt \
    && python3 -m venv --system-site-packages --without-pip /opt/venv
WORKDIR /app

COPY pyproject.toml README.md ./
# flash4: the exact tier's attention on Hopper/Blackwell (FlashAttention 4); other GPUs run SDPA's kernels.
# fp8attn: the fast tier's self-attention on cuDNN's fp8 kernel (GPUs with fp8 tensor cores).
RUN python3 -m pip --python /opt/venv/bin/python install --constraint /opt/base-torch.txt ".[worker,flash4,fp8attn]"
COPY shared ./shared
COPY services ./services
COPY tools ./tools
COPY migrations ./migrations
RUN python3 -m pip --python /opt/venv/bin/python install --no-deps -e . \
    && /opt/venv/bin/python -c "import torch; assert torch.version.cuda, 'the base image CUDA torch was replaced'" \
    && /opt/venv/bin/vidq --help > /dev/null

# The runtime stage starts from the same base: the venv links to its Python and reads its site-packages (torch).
FROM ${CUDA_TORCH_IMAGE} AS worker
LABEL org.opencontainers.image.title="vidq-worker" \
      org.opencontainers.image.description="vidq video worker on the PyTorch CUDA runtime (one worker per GPU)"

RUN groupadd --system --gid 10001 vidq \
    && useradd --system --uid 10001 --gid vidq --home-dir /home/vidq --create-home --shell /usr/sbin/nologin vidq \
    && mkdir -p /models /var/cache/vidq/compile && chown 10001:10001 /models /var/cache/vidq/compile

COPY --from=builder-gpu /opt/venv /opt/venv
COPY --from=builder-gpu /app /app

# VIDQ_DEVICE=cuda: a GPU worker started without a GPU fails at once instead of rendering on the CPU for hours.
# VIDQ_WORKER_COMPILE_CACHE_DIR: compiled kernels, a volume in compose (kept across restarts of the worker).
# NVIDIA_DRIVER_CAPABILITIES: `utility` gives NVML (GPU memory/utilisation metrics) besides `compute`.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/models/huggingface \
    HF_HUB_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    VIDQ_DEVICE=cuda \
    VIDQ_WORKER_COMPILE_CACHE_DIR=/var/cache/vidq/compile

WORKDIR /app
USER 10001:10001
EXPOSE 9808

# Building a real model at start (preload) can take minutes: a long start period before failures count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 CMD ["vidq", "worker-alive"]

# One worker process per GPU (concurrency 1); SIGTERM is Celery's warm shutdown (see the CPU stage above).
ENTRYPOINT ["vidq"]
CMD ["worker", "--role", "video", "--concurrency", "1"]
