"""The cache a process uses, built from its settings (workers and the prewarmer call this once per process)."""

from __future__ import annotations

import redis

from shared.infra.config import Settings
from shared.infra.redis_clients import broker_client, client
from shared.textcache.hierarchy import CachePolicy, EmbeddingCache, Neighbours
from shared.textcache.hot import HotPrompts
from shared.textcache.monitor import HitCounter
from shared.textcache.tiers import L1Cache, RedisTier

OFF = "off"


def control_client(settings: Settings, *, blocking_s: float = 0.0) -> redis.Redis:
    """The broker's Redis, where the monitors, the hot-prompt sketch, the mode and encode requests live. A client
    for blocking calls (BLPOP) of up to ``blocking_s`` gets a socket timeout above that."""
    timeout = max(settings.redis_socket_timeout_s, blocking_s + settings.redis_socket_timeout_s)
    return broker_client(
        settings,
        timeout_s=timeout if blocking_s else settings.cache_redis_timeout_s,
        connect_timeout_s=settings.cache_redis_timeout_s,
    )


def tier_client(url: str, settings: Settings) -> redis.Redis | None:
    """A tier's Redis: ``url``, or the broker's when empty; None when "off"."""
    if url.strip().lower() == OFF:
        return None
    return client(url or str(settings.broker_url), timeout_s=settings.cache_redis_timeout_s)


def counter_and_sketch(settings: Settings, control: redis.Redis | None) -> tuple[HitCounter, HotPrompts]:
    prefix = settings.broker_key_prefix
    counter = HitCounter(
        control, prefix=prefix, window_s=settings.cache_window_s, retention_s=settings.cache_window_retention_s
    )
    hot = HotPrompts(
        control, prefix=prefix, max_entries=settings.cache_hot_max, half_life_s=settings.cache_hot_half_life_s
    )
    counter.add_flush_step(hot.flush_step)
    return counter, hot


def build_cache(
    settings: Settings, *, l1: bool = True, neighbours: Neighbours | None = None, flusher: bool = True
) -> EmbeddingCache:
    """The process's cache. ``l1=False`` for the prewarmer (it keeps nothing in process); ``flusher`` starts the
    thread that sends hit counts to Redis every second."""
    control = control_client(settings)
    prefix = settings.broker_key_prefix
    l2_client = tier_client(settings.cache_l2_url, settings)
    l3_client = tier_client(settings.cache_l3_url, settings)
    counter, hot = counter_and_sketch(settings, control)
    if flusher:
        counter.start_flusher()
    return EmbeddingCache(
        l1=L1Cache(settings.cache_l1_max_bytes) if l1 else None,
        l2=RedisTier(
            "l2", l2_client, prefix=prefix, ttl_s=settings.cache_l2_ttl_s, backoff_s=settings.cache_tier_backoff_s
        )
        if l2_client is not None
        else None,
        l3=RedisTier(
            "l3",
            l3_client,
            prefix=prefix,
            ttl_s=settings.cache_l3_ttl_s,
            zstd_level=settings.cache_l3_zstd_level,
            backoff_s=settings.cache_tier_backoff_s,
        )
        if l3_client is not None
        else None,
        counter=counter,
        hot=hot,
        control=control,
        prefix=prefix,
        policy=CachePolicy(
            forward_jobs=settings.cache_forward_jobs,
            compensation_l2_ttl_s=settings.cache_compensation_l2_ttl_s,
            core_keys=settings.cache_core_keys,
        ),
        neighbours=neighbours,
    )
