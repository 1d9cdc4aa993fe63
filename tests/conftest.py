"""Test session: real Postgres and Redis (the machine's when they answer, embedded ones when not) and a real S3
(SeaweedFS) started here. Every process a test starts gets the same VIDQ_* environment.

A test that reaches the stack (the ``stack_env`` fixture, directly or through ``settings``, ``clean_state``,
``api_url`` …) is marked ``integration`` here, so ``pytest -m "not integration"`` runs without any service.
Each session writes its broker keys under a prefix of its own, so suites sharing one Redis database do not
see, or delete, each other's messages."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VIDQ_ENV"] = "test"
os.environ["VIDQ_LOG_JSON"] = "true"


INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"


# tryfirst: the markers must be on the items before -m deselects by them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the closure: settings, clean_state, api_url … all pull in stack_env.
        if "stack_env" in getattr(item, "fixturenames", ()) or item.path.is_relative_to(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    # torch is imported only when a GPU test was collected: it costs seconds.
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start (or reuse) the backing services once; a fresh database per test session."""
    from tools.devstack import DevStack, ensure_database

    base = tmp_path_factory.mktemp("stack")
    db_name = f"vidq_test_{uuid.uuid4().hex[:8]}"
    pg = os.environ.get("VIDQ_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    # The database number is the caller's choice (VIDQ_TEST_REDIS); the key prefix keeps sessions apart in it.
    redis_url = os.environ.get("VIDQ_TEST_REDIS", "redis://127.0.0.1:6379/13")
    key_prefix = f"vidq-test-{uuid.uuid4().hex[:8]}:"
    stack = DevStack()
    urls = stack.start(
        base,
        database_url=pg,
        broker_url=redis_url,
        s3_endpoint=None,
        s3_access_key="vidq-test",
        s3_secret_key="vidq-test-secret",
        bucket="vidq-test",
    )
    database_url = urls.database_url.rsplit("/", 1)[0] + f"/{db_name}"
    ensure_database(database_url)
    # The embedding cache's L2 and L3 in two other databases of the same server (as two Redis servers would be).
    l2_url, l3_url = _other_db(urls.broker_url, 1), _other_db(urls.broker_url, 2)
    env = {
        **stack.env(),
        "VIDQ_DATABASE_URL": database_url,
        "VIDQ_S3_BUCKET": "vidq-test",
        "VIDQ_BROKER_KEY_PREFIX": key_prefix,
        "VIDQ_CACHE_L2_URL": l2_url,
        "VIDQ_CACHE_L3_URL": l3_url,
        "VIDQ_WEBHOOK_ALLOW_PRIVATE": "true",
        # Short leases so a killed worker is noticed within seconds.
        "VIDQ_LEASE_S": "3",
        "VIDQ_HEARTBEAT_S": "0.5",
        "VIDQ_PROGRESS_MIN_INTERVAL_S": "0.05",
        "VIDQ_ENQUEUE_GRACE_S": "0.5",
        # The admission watermark is checked on every submit, but far above what any test queues (the watermark's
        # own tests start an API with the real levels: tests/integration/test_watermark.py).
        "VIDQ_WATERMARK_IDLE": "100000",
        "VIDQ_WATERMARK_NORMAL": "100000",
        "VIDQ_WATERMARK_BUSY": "100000",
        "VIDQ_WATERMARK_MAX": "100000",
        "VIDQ_SWEEPER_IN_API": "false",
        "VIDQ_WORKER_METRICS_PORT": "0",  # several workers share this host; the metrics test picks a port
        "VIDQ_WEBHOOK_SCHEDULE_S": "[0.2,0.5,1]",  # the Svix schedule, compressed: 4 attempts in under 2 s
        "VIDQ_WEBHOOK_TIMEOUT_S": "3",
        # Renders hold after each step while this file exists (the `hold` fixture of tests/integration).
        "VIDQ_WORKER_FAULT_HOLD_FILE": str(base / "hold"),
        "VIDQ_WORKER_COMPILE_CACHE_DIR": str(base / "compile"),
    }
    os.environ.update(env)
    from shared.infra.config import get_settings

    get_settings.cache_clear()
    from shared.infra.migrate import upgrade

    upgrade(get_settings())
    yield env
    import redis

    from shared.infra.db import dispose_engines

    dispose_engines()
    _drop_database(urls.database_url.rsplit("/", 1)[0] + "/postgres", db_name)  # on the server the session used
    with contextlib.suppress(redis.RedisError):  # a broker that is gone already has nothing of ours left
        for url in (urls.broker_url, l2_url, l3_url):
            _delete_broker_keys(url, key_prefix)
    stack.stop()


def _other_db(redis_url: str, offset: int) -> str:
    """``redis://host:port/N`` → the same server's database N + offset (mod 16)."""
    base, _, db = redis_url.rpartition("/")
    return f"{base}/{(int(db or 0) + offset) % 16}"


def _drop_database(maintenance_url: str, name: str) -> None:
    import psycopg

    url = maintenance_url.replace("+psycopg", "")
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.Error:
        pass


def _delete_broker_keys(broker_url: str, prefix: str) -> int:
    """Delete this session's broker keys (SCAN + DEL), never another session's: no FLUSHDB."""
    import redis

    if not prefix:
        raise ValueError("refusing to delete every key: the broker key prefix is empty")
    pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in prefix) + "*"
    deleted = 0
    with redis.Redis.from_url(broker_url, socket_timeout=5) as client:
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += int(client.delete(*batch))
                batch.clear()
        if batch:
            deleted += int(client.delete(*batch))
    return deleted


@pytest.fixture(scope="session")
def settings(stack_env: dict[str, str]):  # type: ignore[no-untyped-def]
    from shared.infra.config import get_settings

    return get_settings()


@pytest.fixture
def clean_state(settings) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """Empty tables and this session's queues before a test that counts rows or messages."""
    from sqlalchemy import text

    from shared.infra.db import get_engine

    with get_engine(settings).begin() as conn:
        conn.execute(
            text(
                "TRUNCATE jobs, job_transitions, idempotency_keys, webhook_deliveries, api_keys, tenants, fair_clocks,"
                " motion_prototype_sets CASCADE"
            )
        )
        conn.execute(text("DELETE FROM pools WHERE name <> 'stable'"))  # routing rules: every job to stable
    for url in (str(settings.broker_url), settings.cache_l2_url, settings.cache_l3_url):
        _delete_broker_keys(url, settings.broker_key_prefix)
    yield


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
