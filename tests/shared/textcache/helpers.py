"""What the embedding-cache tests share (tests/shared/textcache/, tests/services/prewarmer/ and
tests/integration/test_embedding_cache.py): the tiny model's text encoder, an encoder that counts its calls, and
the raw view of the L2/L3 tiers in the session's Redis."""

from __future__ import annotations

from typing import Any

import redis
import torch

from shared.infra.config import Settings
from shared.render.registry import TINY_WAN
from shared.render.text import TextEncoder, build_text_encoder
from shared.textcache.codec import unpack
from shared.textcache.factory import build_cache, control_client
from shared.textcache.hierarchy import EmbeddingCache
from shared.textcache.remote import RemoteEncoder

CPU = torch.device("cpu")


def tiny_encoder() -> TextEncoder:
    """The text encoder of the tiny model, on CPU (a module fixture builds it once)."""
    return build_text_encoder(TINY_WAN, device=CPU, dtype=torch.float32)


class CountingEncoder:
    """The real encoder, counting what it is asked to encode (what no tier held)."""

    def __init__(self, encoder: TextEncoder) -> None:
        self.encoder = encoder
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> list[torch.Tensor]:
        self.calls.append(list(texts))
        return self.encoder.encode(texts)


def counts(cache: EmbeddingCache) -> dict[str, int]:
    """The cache's pending (not yet flushed) hit/miss counts."""
    return dict(cache.counter._pending)


def tier_redis(settings: Settings, tier: str) -> redis.Redis:
    """L2 and L3 are two databases of the test Redis (tests/conftest.py)."""
    return redis.Redis.from_url(settings.cache_l2_url if tier == "l2" else settings.cache_l3_url)


def raw(settings: Settings, tier: str, key: str) -> bytes | None:
    value = tier_redis(settings, tier).get(f"{settings.broker_key_prefix}vidq:emb:{tier}:{key}")
    return value if isinstance(value, bytes) else None


def stored(settings: Settings, tier: str, key: str, encoder: TextEncoder) -> torch.Tensor:
    value = raw(settings, tier, key)
    assert value is not None
    return unpack(value, key=key, identity=encoder.identity)


def ttl(settings: Settings, tier: str, key: str) -> int:
    return int(tier_redis(settings, tier).ttl(f"{settings.broker_key_prefix}vidq:emb:{tier}:{key}"))


def new_cache(settings: Settings, **changes: Any) -> EmbeddingCache:
    return build_cache(settings.model_copy(update=changes), flusher=False)


def remote(settings: Settings, timeout_s: float) -> RemoteEncoder:
    return RemoteEncoder(
        control_client(settings, blocking_s=timeout_s), prefix=settings.broker_key_prefix, timeout_s=timeout_s
    )
