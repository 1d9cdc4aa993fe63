"""The embedding cache as a worker and the prewarmer use it: L1 → L2 → L3 → encode, with promotion and write-through.

``EmbeddingCache.get(identity, texts, encode)`` returns one (n, hidden) tensor per text:

1. L1 (this process). A hit costs nothing.
2. L2 (hot Redis). A hit is promoted to L1, and the prompts of the next ``forward_jobs`` queued jobs are pulled
   from L2/L3 into L1 in the background (the next ``cache_forward_jobs`` queued jobs).
3. L3 (warm Redis, compressed). A hit is promoted to L2 and L1.
4. Nowhere: ``encode(texts)`` (the worker's own encoder, or a request to the prewarmer), written through to every
   tier.

Every demand lookup counts a hit or miss per tier (monitor.HitCounter) and one use of the text in the hot-prompt
sketch. An entry that fails its checks (codec.unpack) is counted as corrupt, deleted, and treated as a miss. A tier
that fails is skipped (tiers.TierDown): the lookup falls through, and at worst the text is encoded — a cache outage
never fails a job.

In cold-start compensation (the prewarmer's mode, read from Redis every few seconds), what a worker writes to L2
that is not a core key (the hottest prompts) lives ``compensation_l2_ttl_s`` only, so the small hot tier keeps what
the prewarmer put there: the queued jobs' and the hottest prompts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
import torch

from shared.render.text import EncoderIdentity
from shared.textcache.codec import CorruptEntry, pack, unpack
from shared.textcache.hot import HotPrompts
from shared.textcache.monitor import PREFETCH, HitCounter, mode_key
from shared.textcache.tiers import L1Cache, RedisTier, TierDown

log = logging.getLogger("vidq.cache")

Encode = Callable[[list[str]], list[torch.Tensor]]
# The next queued jobs' texts, each with the identity it is encoded under (the worker reads its queues).
Neighbours = Callable[[int], Sequence[tuple[EncoderIdentity, str]]]


@dataclass(frozen=True, slots=True)
class CachePolicy:
    forward_jobs: int = 3
    compensation_l2_ttl_s: int = 30
    core_keys: int = 1000
    mode_refresh_s: float = 5.0


class EmbeddingCache:
    def __init__(
        self,
        *,
        l1: L1Cache | None,
        l2: RedisTier | None,
        l3: RedisTier | None,
        counter: HitCounter,
        hot: HotPrompts,
        control: redis.Redis | None,
        prefix: str,
        policy: CachePolicy,
        neighbours: Neighbours | None = None,
    ) -> None:
        self.l1, self.l2, self.l3 = l1, l2, l3
        self.counter = counter
        self.hot = hot
        self.control = control
        self.prefix = prefix
        self.policy = policy
        self.neighbours = neighbours
        self._forward = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vidq-forward-prewarm")
        self._forward_busy = threading.Lock()
        self._mode = ("normal", 0.0)

    # --- the demand path ---------------------------------------------------------------------------------------

    def get(self, identity: EncoderIdentity, texts: Sequence[str], encode: Encode) -> list[torch.Tensor]:
        keys = {identity.key(t): t for t in texts}  # a prompt equal to its negative prompt is looked up once
        for key, text in keys.items():
            self.hot.note(key, model=identity.model, dtype=identity.dtype, text=text)
        found = self._lookup(identity, list(keys), count=True)
        missing = [k for k in keys if k not in found]
        if missing:
            rows = encode([keys[k] for k in missing])
            fresh = dict(zip(missing, rows, strict=True))
            self._fill_l1(fresh)
            self.store_shared({k: pack(k, v) for k, v in fresh.items()})
            found.update(fresh)
        return [found[identity.key(t)] for t in texts]

    def _lookup(self, identity: EncoderIdentity, keys: list[str], *, count: bool) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        record = self.counter.record if count else _prefetch_record
        if self.l1 is not None:
            for key in keys:
                rows = self.l1.get(key)
                if rows is not None:
                    found[key] = rows
            record("l1", "hit", len(found))
            record("l1", "miss", len(keys) - len(found))
        missing = [k for k in keys if k not in found]
        if missing and self.l2 is not None:
            hits, _ = self._read(self.l2, identity, missing, record)
            found.update(hits)
            self._fill_l1(hits)
            if hits and self.l1 is not None and count:
                self._forward_prewarm()
            missing = [k for k in missing if k not in hits]
        if missing and self.l3 is not None:
            hits, payloads = self._read(self.l3, identity, missing, record)
            found.update(hits)
            self._put_l2(payloads)  # the bytes L3 returned, checked: no second serialization
            self._fill_l1(hits)
        return found

    def _read(
        self, tier: RedisTier, identity: EncoderIdentity, keys: list[str], record: Callable[[str, str, int], None]
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        """The entries of ``keys`` that ``tier`` holds and that pass their checks: as tensors, and as their bytes."""
        try:
            raw = tier.get_many(keys)
        except TierDown:
            record(tier.name, "error", len(keys))
            return {}, {}
        hits: dict[str, torch.Tensor] = {}
        payloads: dict[str, bytes] = {}
        corrupt = []
        for key, value in raw.items():
            try:
                if value is None:
                    raise CorruptEntry("does not decompress")
                hits[key] = unpack(value, key=key, identity=identity)
                payloads[key] = value
            except CorruptEntry as exc:
                corrupt.append(key)
                log.warning("corrupt cache entry ignored", extra={"tier": tier.name, "key": key, "error": str(exc)})
        record(tier.name, "hit", len(hits))
        record(tier.name, "miss", len(keys) - len(hits))
        record(tier.name, "corrupt", len(corrupt))
        if corrupt:
            with contextlib.suppress(TierDown):
                tier.delete(corrupt)
        return hits, payloads

    def _fill_l1(self, entries: dict[str, torch.Tensor]) -> None:
        if self.l1 is not None:
            for key, rows in entries.items():
                self.l1.put(key, rows)

    def store_shared(self, payloads: dict[str, bytes], *, core: bool = False) -> None:
        """Write entries (codec.pack bytes) to L2 and L3; a tier that is down is skipped. ``core``: the prewarmer's
        (queued jobs' and hottest prompts), which keep L2's normal TTL in compensation too."""
        self._put_l2(payloads, core=core)
        if self.l3 is not None and payloads:
            with contextlib.suppress(TierDown):
                self.l3.put_many(payloads)

    def _put_l2(self, payloads: dict[str, bytes], *, core: bool = False) -> None:
        if self.l2 is None or not payloads:
            return
        ttl: dict[str, int] = {}
        if not core and self.mode() == "compensating":
            hottest = self.hot.core(list(payloads), core_keys=self.policy.core_keys) if self.control else set()
            ttl = {k: self.policy.compensation_l2_ttl_s for k in payloads if k not in hottest}
        with contextlib.suppress(TierDown):
            self.l2.put_many(payloads, ttl_s=ttl)

    def mode(self) -> str:
        """The prewarmer's mode, read from Redis at most every ``mode_refresh_s``."""
        mode, read_at = self._mode
        if self.control is None or time.monotonic() - read_at < self.policy.mode_refresh_s:
            return mode
        try:
            raw = self.control.get(mode_key(self.prefix))
            mode = raw.decode() if isinstance(raw, bytes) else "normal"
        except redis.RedisError:
            pass
        self._mode = (mode, time.monotonic())
        return mode

    # --- forward prewarm ---------------------------------------------------------------------------------------

    def _forward_prewarm(self) -> None:
        if self.neighbours is None or self.policy.forward_jobs <= 0:
            return
        if not self._forward_busy.acquire(blocking=False):
            return  # one pass at a time; the running one already looks at the queue's head
        try:
            self._forward.submit(self._forward_pass)
        except RuntimeError:  # shut down
            self._forward_busy.release()

    def _forward_pass(self) -> None:
        try:
            assert self.neighbours is not None
            by_identity: dict[EncoderIdentity, list[str]] = {}
            for identity, text in self.neighbours(self.policy.forward_jobs):
                key = identity.key(text)
                if self.l1 is None or key not in self.l1:
                    by_identity.setdefault(identity, []).append(key)
            for identity, keys in by_identity.items():
                self._lookup(identity, keys, count=False)
        except Exception:
            log.warning("forward prewarm failed", exc_info=True)
        finally:
            self._forward_busy.release()

    def forward_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait for a running forward prewarm (tests, benchmarks)."""
        if self._forward_busy.acquire(timeout=timeout_s):
            self._forward_busy.release()
            return True
        return False


def _prefetch_record(tier: str, result: str, n: int = 1) -> None:
    if n > 0:
        PREFETCH.labels(tier, result).inc(n)
