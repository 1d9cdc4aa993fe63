"""The monitors' view for operators (``vidq cache stats``, ``GET /v1/admin/cache/stats``): no torch imported."""

from __future__ import annotations

from typing import Any

import redis

from shared.config import Settings
from shared.textcache import monitor


def stats_for(settings: Settings, *, windows: int) -> dict[str, Any]:
    client = redis.Redis.from_url(
        str(settings.broker_url),
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_socket_timeout_s,
    )
    try:
        return monitor.stats(
            client, prefix=settings.broker_key_prefix, window_s=settings.cache_window_s, count=max(1, windows)
        )
    finally:
        client.close()
