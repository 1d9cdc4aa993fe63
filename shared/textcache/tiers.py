"""The cache tiers: L1, a byte-budgeted LRU in the process; L2 and L3, Redis.

A Redis tier has short socket timeouts and, after a failed call, stays out of the way for ``backoff_s``: with its
Redis gone a job pays one timeout, not one per lookup, and encodes instead (a cache outage never fails a job).
L3 entries are zstd-compressed; L2 entries are stored as they are (hot: read often, decompressing costs time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import redis
import torch
import zstandard

log = logging.getLogger("vidq.cache")
T = TypeVar("T")


class L1Cache:
    """Least recently used first out, within ``max_bytes`` of tensor storage. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            rows = self._entries.get(key)
            if rows is not None:
                self._entries.move_to_end(key)
            return rows

    def put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.numel() * old.element_size()
            self._entries[key] = rows
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.numel() * evicted.element_size()


class TierDown(Exception):
    """The tier's Redis failed just now, or is in its back-off after a failure."""


class RedisTier:
    """One Redis tier: values are safetensors bytes (shared/textcache/codec.py), compressed when ``zstd_level``."""

    def __init__(
        self,
        name: str,
        client: redis.Redis,
        *,
        prefix: str,
        ttl_s: int,
        zstd_level: int | None = None,
        backoff_s: float = 10.0,
    ) -> None:
        self.name = name
        self.client = client
        self.prefix = f"{prefix}vidq:emb:{name}:"
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self._compressor = zstandard.ZstdCompressor(level=zstd_level) if zstd_level is not None else None
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if not self.available:
            raise TierDown(f"{self.name} in back-off")
        try:
            return fn()
        except redis.RedisError as exc:
            self._down_until = time.monotonic() + self.backoff_s
            log.warning(
                "cache tier unreachable; skipped for a while",
                extra={"tier": self.name, "call": what, "backoff_s": self.backoff_s, "error": repr(exc)[:200]},
            )
            raise TierDown(f"{self.name}: {exc}") from exc

    def _encode(self, value: bytes) -> bytes:
        return self._compressor.compress(value) if self._compressor is not None else value

    def _decode(self, value: bytes) -> bytes | None:
        if self._compressor is None:
            return value
        try:
            return zstandard.ZstdDecompressor().decompress(value, max_output_size=64 * 1024 * 1024)
        except zstandard.ZstdError:
            return None  # corrupt: the caller counts it as such

    def get_many(self, keys: list[str]) -> dict[str, bytes | None]:
        """The stored bytes of each key that has an entry (None for one that does not decompress)."""
        if not keys:
            return {}
        values = self._call("mget", lambda: self.client.mget([self.prefix + k for k in keys]))
        return {k: self._decode(bytes(v)) for k, v in zip(keys, values, strict=True) if isinstance(v, bytes)}

    def put_many(self, items: Mapping[str, bytes], *, ttl_s: Mapping[str, int] | None = None) -> None:
        """Store each entry with the tier's TTL (or its own from ``ttl_s``)."""
        if not items:
            return

        def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(self.prefix + key, self._encode(value), ex=(ttl_s or {}).get(key, self.ttl_s))
            pipe.execute()

        self._call("set", write)

    def delete(self, keys: Iterable[str]) -> None:
        names = [self.prefix + k for k in keys]
        if names:
            self._call("delete", lambda: self.client.delete(*names))

    def existing(self, keys: list[str]) -> set[str]:
        """The keys that have an entry (one round trip)."""
        if not keys:
            return set()

        def check() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + key)
            return pipe.execute()

        found = self._call("exists", check)
        return {k for k, n in zip(keys, found, strict=True) if n}
