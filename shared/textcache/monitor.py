"""Hit-rate monitors: every embedding lookup counts a hit or a miss per tier, in windows, cluster-wide.

A process counts locally (and in its Prometheus counters) and a background thread adds its counts to the current
window's hash in the broker Redis every second (``HINCRBY``; one round trip per second, not per lookup). Window i
covers [i × window_s, (i + 1) × window_s) of wall-clock time. ``read_windows`` reads the last complete ones; the
prewarmer's ``HitRateMonitor`` turns them into the mode (normal / compensating), ``vidq cache stats`` and
``GET /v1/admin/cache/stats`` show them.

No torch here: the API and the CLI read the windows too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client import Counter as PromCounter

log = logging.getLogger("vidq.cache")

TIERS = ("l1", "l2", "l3")
RATES = (*TIERS, "overall")  # what a window reports a rate for
LOOKUPS = PromCounter(
    "vidq_embedding_cache_lookups",
    "Embedding lookups by tier and result (hit, miss, corrupt, error)",
    ["tier", "result"],
)
PREFETCH = PromCounter(
    "vidq_embedding_cache_prefetch", "Forward-prewarm reads into L1 by tier and result (not demand)", ["tier", "result"]
)


def window_key(prefix: str, index: int) -> str:
    return f"{prefix}vidq:cache:window:{index}"


def mode_key(prefix: str) -> str:
    """Where the prewarmer publishes its mode (normal / compensating) for workers and operators."""
    return f"{prefix}vidq:cache:mode"


@dataclass(frozen=True, slots=True)
class TierCount:
    hits: int = 0
    misses: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


@dataclass(frozen=True, slots=True)
class Window:
    index: int
    start: float  # unix seconds
    tiers: dict[str, TierCount] = field(default_factory=dict)

    def tier(self, name: str) -> TierCount:
        """One level's counts, or ``overall`` (see below)."""
        if name == "overall":
            return self.overall
        return self.tiers.get(name, TierCount())

    @property
    def overall(self) -> TierCount:
        """Lookups served by any tier: every lookup starts at L1, so L1's lookups are all of them."""
        total = self.tier("l1").lookups
        hits = sum(self.tier(t).hits for t in TIERS)
        return TierCount(hits=hits, misses=total - hits)


class HitCounter:
    """This process's counts, flushed to the current window in Redis by ``start_flusher``'s thread."""

    def __init__(self, client: redis.Redis | None, *, prefix: str, window_s: float, retention_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.window_s = window_s
        self.retention_s = retention_s
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._extra: list[Callable[[Any], None]] = []  # more writes for the same pipeline (the hot-prompt sketch)

    def record(self, tier: str, result: str, n: int = 1) -> None:
        """``result``: hit or miss (counted in the windows), corrupt or error (Prometheus only)."""
        if n <= 0:
            return
        LOOKUPS.labels(tier, result).inc(n)
        if result in ("hit", "miss"):
            with self._lock:
                self._pending[f"{tier}:{result}"] += n

    def add_flush_step(self, step: Callable[[Any], None]) -> None:
        """``step(pipeline)`` runs at every flush, in the same round trip."""
        self._extra.append(step)

    def flush(self, now: float | None = None) -> None:
        """Add the pending counts to the current window. Counts a failed flush could not write are kept for the
        next one (a Redis blip loses nothing; a long outage only delays the counts)."""
        if self.client is None:
            return
        with self._lock:
            pending, self._pending = self._pending, Counter()
        index = int((time.time() if now is None else now) // self.window_s)
        key = window_key(self.prefix, index)
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, n in pending.items():
                pipe.hincrby(key, name, n)
            if pending:
                pipe.expire(key, self.retention_s)
            for step in self._extra:
                step(pipe)
            pipe.execute()
        except redis.RedisError as exc:
            with self._lock:
                self._pending.update(pending)
            log.debug("hit counts not flushed", extra={"error": repr(exc)[:200]})

    def start_flusher(self, interval_s: float = 1.0) -> threading.Thread:
        def loop() -> None:
            while True:
                time.sleep(interval_s)
                self.flush()

        thread = threading.Thread(target=loop, name="vidq-cache-counts", daemon=True)
        thread.start()
        return thread


def read_windows(
    client: redis.Redis, *, prefix: str, window_s: float, count: int, now: float | None = None
) -> list[Window]:
    """The last ``count`` complete windows, oldest first (the current, still filling one is left out)."""
    current = int((time.time() if now is None else now) // window_s)
    indices = list(range(current - count, current))
    pipe = client.pipeline(transaction=False)
    for index in indices:
        pipe.hgetall(window_key(prefix, index))
    windows = []
    for index, raw in zip(indices, pipe.execute(), strict=True):
        counts = {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}
        tiers = {
            tier: TierCount(counts.get(f"{tier}:hit", 0), counts.get(f"{tier}:miss", 0))
            for tier in TIERS
            if f"{tier}:hit" in counts or f"{tier}:miss" in counts
        }
        windows.append(Window(index=index, start=index * window_s, tiers=tiers))
    return windows


@dataclass(frozen=True, slots=True)
class ModeChange:
    mode: str  # "compensating" or "normal"
    reason: str
    window: int


class HitRateMonitor:
    """Cold-start compensation (docs/architecture.md, "Prompt-embedding caches"): a monitored tier below
    ``threshold`` for ``low_windows`` windows in a row → compensating; every monitored tier at or above it for
    ``recover_windows`` in a row → normal.

    A monitored "tier" is ``overall`` (lookups served by any level: the default) or one level, ``l1``/``l2``/``l3``
    (the share of the lookups reaching that level that it serves). The levels' own rates are low in a healthy
    cluster (L1's falls with the number of workers; L3 only sees what L2 lacks, mostly prompts never seen before:
    benchmarks/results/cache_replay_*.md), so judging them trips compensation on a warm cache; they are there for
    operators who want it.

    A window with fewer than ``min_lookups`` lookups at a tier does not judge that tier; if no monitored tier has
    enough but the cluster looked up at least ``min_lookups`` texts, the window counts as good (the sparse level
    was hardly needed); a window with fewer lookups in all is idle and changes nothing. Feed windows in order with
    ``observe``; each is judged once.
    """

    def __init__(
        self,
        *,
        threshold: float,
        low_windows: int,
        recover_windows: int,
        min_lookups: int,
        tiers: Sequence[str] = ("overall",),
    ) -> None:
        self.threshold = threshold
        self.low_windows = low_windows
        self.recover_windows = recover_windows
        self.min_lookups = min_lookups
        self.tiers = tuple(tiers)
        self.mode = "normal"
        self._low_run: dict[str, int] = dict.fromkeys(self.tiers, 0)
        self._good_run = 0
        self._last_index: int | None = None

    def observe(self, windows: Iterable[Window]) -> ModeChange | None:
        change = None
        for window in windows:
            if self._last_index is not None and window.index <= self._last_index:
                continue
            self._last_index = window.index
            change = self._judge(window) or change
        return change

    def _judge(self, window: Window) -> ModeChange | None:
        counts = {t: window.tier(t) for t in self.tiers}
        judged = {t: c for t, c in counts.items() if c.lookups >= self.min_lookups}
        if not judged and window.overall.lookups < self.min_lookups:
            return None  # idle
        low = []
        for tier, count in judged.items():
            if (count.rate or 0.0) < self.threshold:
                self._low_run[tier] += 1
                low.append(tier)
            else:
                self._low_run[tier] = 0
        self._good_run = 0 if low else self._good_run + 1
        if self.mode == "normal":
            tripped = [t for t in low if self._low_run[t] >= self.low_windows]
            if tripped:
                self.mode = "compensating"
                rates = ", ".join(f"{t} {judged[t].rate:.1%}" for t in tripped)
                reason = f"below {self.threshold:.0%} for {self.low_windows} windows: {rates}"
                return ModeChange("compensating", reason, window.index)
        elif self._good_run >= self.recover_windows:
            self.mode = "normal"
            self._low_run = dict.fromkeys(self.tiers, 0)
            return ModeChange("normal", f"every judged rate at or above {self.threshold:.0%}", window.index)
        return None


def stats(client: redis.Redis, *, prefix: str, window_s: float, count: int) -> dict[str, Any]:
    """What ``vidq cache stats`` and the operator endpoint show: the last windows per tier, totals and the mode."""
    windows = read_windows(client, prefix=prefix, window_s=window_s, count=count)
    raw_mode = client.get(mode_key(prefix))
    mode = raw_mode.decode() if isinstance(raw_mode, bytes) else (raw_mode or "unknown")

    def as_dict(c: TierCount) -> dict[str, Any]:
        return {"hits": c.hits, "misses": c.misses, "hit_rate": None if c.rate is None else round(c.rate, 4)}

    totals = {t: TierCount(sum(w.tier(t).hits for w in windows), sum(w.tier(t).misses for w in windows)) for t in RATES}
    return {
        "window_s": window_s,
        "mode": mode,
        "totals": {t: as_dict(c) for t, c in totals.items()},
        "windows": [{"start": w.start, **{t: as_dict(w.tier(t)) for t in RATES}} for w in windows],
    }
