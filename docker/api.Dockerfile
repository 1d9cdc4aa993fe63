# syntax=docker/dockerfile:1
#
# vidq CPU image: the REST API, the sweeper, migrations, Flower and the webhook worker.
# No torch, no diffusers: the API sends tasks by name and never imports them (DESIGN.md, invariant 6), so the
# project is installed WITHOUT the `worker` extra. The build fails if torch sneaks in through a dependency.
#
#   docker build -f docker/api.Dockerfile -t vidq-api .        (context: the repository root)
#
# Base images are pinned by tag. Pinning by digest as well (python:3.12.11-slim-bookworm@sha256:…) makes the
# build fully reproducible; add it once your registry mirror is fixed.
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

# ---- builder: a virtual environment with vidq and its dependencies ------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app

# Dependencies first, from pyproject.toml alone (no packages yet), so this layer is reused until pyproject changes.
COPY pyproject.toml README.md ./
RUN pip install .

# The code. Installed in editable mode ON PURPOSE: shared/infra/migrate.py finds Alembic's migrations/ beside the
# packages (shared/../migrations), which a plain wheel install does not carry. The tree stays at /app in the
# runtime stage, at the same path, so the venv's import hook keeps pointing at it.
COPY shared ./shared
COPY services ./services
COPY tools ./tools
COPY migrations ./migrations
RUN pip install --no-deps -e . \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    && vidq --help > /dev/null

# ---- runtime ------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS api

LABEL org.opencontainers.image.title="vidq-api" \
      org.opencontainers.image.description="vidq API, sweeper, migrations, Flower and webhook worker (CPU, no torch)"

# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it without resolving names.
RUN groupadd --system --gid 10001 vidq \
    && useradd --system --uid 10001 --gid vidq --home-dir /home/vidq --create-home --shell /usr/sbin/nologin vidq

COPY --from=builder /opt/venv /opt/venv
# Owned by root and read-only to the service user: the code cannot be changed by the process that runs it.
COPY --from=builder /app /app

# VIDQ_API_HOST: Settings' default (127.0.0.1) is right on a laptop and wrong in a container, where the port is
# published from outside. Everything else comes from the environment at run time (.env, compose, k8s).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIDQ_API_HOST=0.0.0.0 \
    VIDQ_API_PORT=8000

WORKDIR /app
USER 10001:10001
EXPOSE 8000

# Liveness of the API process only (/readyz checks Postgres, Redis and S3; that is for readiness, not restarts).
# No curl in a slim image: the standard library does it. Other commands run from this image (flower, sweep,
# worker --role webhooks, migrate) override or disable this check where they run (docker-compose.yml).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"

ENTRYPOINT ["vidq"]
# Migrations are their own step here (`vidq migrate`: compose's `migrate` service, the k8s Job), so an API
# container starts fast and never needs DDL rights; `vidq api --migrate` is also safe with many replicas (the
# migration holds a Postgres advisory lock), which the k8s manifests use.
CMD ["api", "--no-migrate"]
