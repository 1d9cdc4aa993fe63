"""The monitors' view for operators (``vidq cache stats``, ``GET /v1/admin/cache/stats``): no torch imported."""

from __future__ import annotations

from typing import Any

from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client
from shared.textcache import monitor


def stats_for(settings: Settings, *, windows: int) -> dict[str, Any]:
    client = broker_client(settings)
    try:
        return monitor.stats(
            client, prefix=settings.broker_key_prefix, window_s=settings.cache_window_s, count=max(1, windows)
        )
    finally:
        client.close()
