"""The tenants' hottest prompts: a bounded frequency sketch in the broker Redis (top-K with exponential decay).

Workers note every text they look up; the counts reach Redis with the hit counts' flush (one round trip a second).
The sketch is a sorted set of cache keys scored by decayed frequency, plus a hash from key to what the prewarmer
needs to encode it again (model, dtype, text). The prewarmer keeps it bounded: every cycle it multiplies the
scores by 2^(-elapsed / half-life) and drops all but the ``max_entries`` best (Space-Saving style; a prompt seen
once long ago makes room for a new one). Its top ``core_keys`` are the core keys of cold-start compensation.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis


@dataclass(frozen=True, slots=True)
class HotPrompt:
    key: str
    model: str
    dtype: str
    text: str


class HotPrompts:
    def __init__(self, client: redis.Redis | None, *, prefix: str, max_entries: int, half_life_s: float) -> None:
        self.client = client
        self.scores = f"{prefix}vidq:cache:hot"
        self.texts = f"{prefix}vidq:cache:hot:text"
        self.decayed_at = f"{prefix}vidq:cache:hot:decayed_at"
        self.max_entries = max_entries
        self.half_life_s = half_life_s
        self._pending: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def note(self, key: str, *, model: str, dtype: str, text: str) -> None:
        """Count one use of ``text`` (sent with the next flush)."""
        with self._lock:
            n, payload = self._pending.get(key, (0, ""))
            self._pending[key] = (n + 1, payload or json.dumps({"m": model, "d": dtype, "t": text}))

    def flush_step(self, pipe: Any) -> None:
        """Adds the pending counts to ``pipe`` (a flush of shared/textcache/monitor.HitCounter)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for key, (n, payload) in pending.items():
            pipe.zincrby(self.scores, n, key)
            pipe.hsetnx(self.texts, key, payload)

    def hottest(self, n: int) -> list[HotPrompt]:
        if self.client is None or n <= 0:
            return []
        keys = [_text(k) for k in self.client.zrevrange(self.scores, 0, n - 1)]
        if not keys:
            return []
        out = []
        for key, raw in zip(keys, self.client.hmget(self.texts, keys), strict=True):
            if raw is None:
                continue
            data = json.loads(raw)
            out.append(HotPrompt(key=key, model=data["m"], dtype=data["d"], text=data["t"]))
        return out

    def core(self, keys: list[str], *, core_keys: int) -> set[str]:
        """Which of ``keys`` rank among the ``core_keys`` hottest."""
        if self.client is None or not keys:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrevrank(self.scores, key)
        return {k for k, rank in zip(keys, pipe.execute(), strict=True) if rank is not None and rank < core_keys}

    def maintain(self, now: float | None = None) -> int:
        """Decay the scores for the time since the last call and trim to ``max_entries``; returns how many prompts
        were dropped. Run by the prewarmer (any number of them: the decay is keyed on a shared timestamp)."""
        if self.client is None:
            return 0
        now = time.time() if now is None else now
        seen = self.client.get(self.decayed_at)
        # Decay in steps of 1/32 half-life (~2% each), not every call: rescoring the whole set costs O(size).
        if seen is None or now - float(_text(seen)) >= self.half_life_s / 32:
            # GETSET: of two prewarmers that decay at once, the second sees ~0 s elapsed and decays ~nothing.
            last = self.client.set(self.decayed_at, repr(now), get=True)
            elapsed = max(0.0, now - float(_text(last))) if last is not None else 0.0
            if elapsed > 0:
                self.client.zunionstore(self.scores, {self.scores: 2.0 ** (-elapsed / self.half_life_s)})
        extra = int(self.client.zcard(self.scores)) - self.max_entries
        if extra <= 0:
            return 0
        dropped = [_text(k) for k in self.client.zrange(self.scores, 0, extra - 1)]
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(self.scores, *dropped)
        pipe.hdel(self.texts, *dropped)
        pipe.execute()
        return len(dropped)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
