"""Test session: real Postgres and Redis (the machine's when they answer, embedded ones when not) and a real S3
(SeaweedFS) started here. Every process a test starts gets the same VIDQ_* environment."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VIDQ_ENV"] = "test"
os.environ["VIDQ_LOG_JSON"] = "true"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start (or reuse) the backing services once; a fresh database per test session."""
    from tools.devstack import DevStack, ensure_database

    base = tmp_path_factory.mktemp("stack")
    db_name = f"vidq_test_{uuid.uuid4().hex[:8]}"
    pg = os.environ.get("VIDQ_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    redis = os.environ.get("VIDQ_TEST_REDIS", "redis://127.0.0.1:6379/13")
    stack = DevStack()
    urls = stack.start(
        base,
        database_url=pg,
        broker_url=redis,
        s3_endpoint=None,
        s3_access_key="vidq-test",
        s3_secret_key="vidq-test-secret",
        bucket="vidq-test",
    )
    database_url = urls.database_url.rsplit("/", 1)[0] + f"/{db_name}"
    ensure_database(database_url)
    env = {
        **stack.env(),
        "VIDQ_DATABASE_URL": database_url,
        "VIDQ_S3_BUCKET": "vidq-test",
        "VIDQ_WEBHOOK_ALLOW_PRIVATE": "true",
        # Short leases so a killed worker is noticed within seconds.
        "VIDQ_LEASE_S": "3",
        "VIDQ_HEARTBEAT_S": "0.5",
        "VIDQ_PROGRESS_MIN_INTERVAL_S": "0.05",
        "VIDQ_EVENTS_POLL_S": "0.1",
        "VIDQ_ENQUEUE_GRACE_S": "0.5",
        "VIDQ_SWEEPER_IN_API": "false",
        "VIDQ_WORKER_METRICS_PORT": "0",  # several workers share this host; the metrics test picks a port
        "VIDQ_WEBHOOK_BACKOFF_BASE_S": "0.2",
        "VIDQ_WEBHOOK_BACKOFF_MAX_S": "1",
        "VIDQ_WEBHOOK_TIMEOUT_S": "3",
    }
    os.environ.update(env)
    from shared.config import get_settings

    get_settings.cache_clear()
    from shared.migrate import upgrade

    upgrade(get_settings())
    yield env
    from shared.db import dispose_engines

    dispose_engines()
    _drop_database(pg, db_name)
    stack.stop()


def _drop_database(maintenance_url: str, name: str) -> None:
    import psycopg

    url = maintenance_url.replace("+psycopg", "")
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.Error:
        pass


@pytest.fixture(scope="session")
def settings(stack_env: dict[str, str]):  # type: ignore[no-untyped-def]
    from shared.config import get_settings

    return get_settings()


@pytest.fixture
def clean_state(settings) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """Empty tables and queues before a test that counts rows or messages."""
    import redis
    from sqlalchemy import text

    from shared.db import get_engine

    with get_engine(settings).begin() as conn:
        conn.execute(
            text("TRUNCATE jobs, job_transitions, idempotency_keys, webhook_deliveries, api_keys, tenants CASCADE")
        )
    redis.Redis.from_url(str(settings.broker_url), socket_timeout=5).flushdb()
    yield


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
