"""Every Redis client vidq makes, sync or asyncio: each with a socket and a connect timeout (no call can hang on a
Redis that stopped answering), and with redis-py's own retries said out loud where they are not its default."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.infra.config import Settings


def client(
    url: str, *, timeout_s: float, connect_timeout_s: float | None = None, retries: int | None = None, **options: Any
) -> redis.Redis:
    """A client of ``url``. ``retries``: how often redis-py retries a failed command at once (None: its default;
    every retry adds a timeout to an outage)."""
    if retries is not None:
        options["retry"] = Retry(NoBackoff(), retries)
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s if connect_timeout_s is None else connect_timeout_s,
        **options,
    )


def broker_client(
    settings: Settings,
    *,
    timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    retries: int | None = None,
    **options: Any,
) -> redis.Redis:
    """A client of the broker's Redis, with the settings' timeout unless ``timeout_s`` says otherwise."""
    timeout = settings.redis_socket_timeout_s if timeout_s is None else timeout_s
    return client(
        str(settings.broker_url), timeout_s=timeout, connect_timeout_s=connect_timeout_s, retries=retries, **options
    )


def async_broker_client(
    settings: Settings, *, retries: int, timeout_s: float | None = None, **options: Any
) -> aioredis.Redis:
    """An asyncio client of the broker's Redis, with the settings' timeout unless ``timeout_s`` says otherwise."""
    timeout = settings.redis_socket_timeout_s if timeout_s is None else timeout_s
    return aioredis.Redis.from_url(
        str(settings.broker_url),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=AsyncRetry(NoBackoff(), retries),
        **options,
    )
