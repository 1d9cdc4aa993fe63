"""The prewarmer: fills the L2/L3 embedding caches before GPU workers need them, and encodes for workers that have
no text encoder of their own (``vidq prewarmer``; one process, any number of replicas is safe).

Each cycle, in this order:

1. **Answer workers.** Encode requests of encoder-free workers (shared/textcache/remote.py) come first, and again
   between batches of the other work, so a worker waits for at most one batch.
2. **Read the monitors.** The last complete hit-rate windows (shared/textcache/monitor.py) go to
   ``HitRateMonitor``: a monitored tier below ``cache_hit_rate_threshold`` for ``cache_low_windows`` windows in a
   row starts **cold-start compensation** (prewarm concurrency ×2, L2 TTL of non-core keys
   ``cache_compensation_l2_ttl_s``, hot keys first), every tier back at or above it for
   ``cache_recover_windows`` ends it. Every change is logged, counted and published for the workers.
3. **Prewarm.** The prompts of queued jobs (queue by queue in the order workers take them, newest submission first
   within a queue: the oldest are about to be claimed, and the worker's own forward prewarm and requests cover
   those) and the hottest prompts of the frequency sketch. What L2 lacks is promoted from L3 or encoded in batches
   of ``prewarmer_concurrency`` and written to L2 and L3 with their normal TTLs (the prewarmer's keys are core).

It loads only text encoders (``build_text_encoder``): on a GPU if it has one, else on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
import torch
from prometheus_client import Counter, Gauge, Histogram

from shared.infra.config import Settings
from shared.infra.tracing import stage_span
from shared.pools.live import live_workers_or_none
from shared.queues import STABLE_POOL, video_queues
from shared.render.precision import compute_dtype, dtype_from_name, dtype_name, resolve_device
from shared.render.text import EncoderIdentity, TextEncoder, build_text_encoder
from shared.textcache.codec import pack
from shared.textcache.factory import build_cache, control_client
from shared.textcache.hierarchy import EmbeddingCache
from shared.textcache.monitor import RATES, HitRateMonitor, mode_key, read_windows
from shared.textcache.remote import EncodeRequest, reply, take_request
from shared.textcache.tiers import TierDown
from shared.textcache.upcoming import QueuedPrompts, peek_job_ids, queued_prompts

log = logging.getLogger("vidq.prewarmer")

ENCODED = Counter("vidq_prewarmer_encoded", "Texts the prewarmer encoded, by why", ["source"])
PROMOTED = Counter("vidq_prewarmer_promoted", "Texts copied from L3 to L2 without encoding")
REQUESTS = Counter("vidq_prewarmer_requests", "Encode requests of encoder-free workers, by result", ["result"])
MODE = Gauge("vidq_prewarmer_compensating", "1 while in cold-start compensation")
MODE_CHANGES = Counter("vidq_prewarmer_mode_changes", "Changes of the prewarmer's mode, by the mode entered", ["mode"])
HIT_RATE = Gauge("vidq_embedding_cache_hit_rate", "Cluster-wide hit rate in the last complete window", ["tier"])
CYCLE = Histogram("vidq_prewarmer_cycle_seconds", "One prewarm cycle")


@dataclass(frozen=True, slots=True)
class Candidate:
    identity: EncoderIdentity
    key: str
    text: str
    source: str  # "queued" or "hot"


@dataclass(slots=True)
class CycleReport:
    mode: str = "normal"
    requests: int = 0
    candidates: int = 0
    promoted: int = 0
    encoded: int = 0
    skipped_models: set[str] = field(default_factory=set)  # queued jobs' models this prewarmer has not loaded

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "skipped_models": sorted(self.skipped_models)}


def workers_dtype(settings: Settings) -> torch.dtype:
    """The dtype a worker configured like this process computes in (VIDQ_DEVICE, VIDQ_CUDA_DTYPE), decided without
    needing that device here: a prewarmer on a CPU node of a GPU cluster still encodes for the GPU workers."""
    if settings.prewarmer_dtype is not None:
        return dtype_from_name(settings.prewarmer_dtype)
    wanted = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return compute_dtype(torch.device(wanted), cuda_dtype=settings.cuda_dtype)


def load_encoders(settings: Settings) -> dict[tuple[str, str], TextEncoder]:
    """The text encoders of ``prewarmer_models`` (default: the default model), keyed by (model, dtype)."""
    device, _ = resolve_device(settings.prewarmer_device, cuda_dtype=settings.cuda_dtype)
    dtype = workers_dtype(settings)
    if device.type == "cpu" and dtype != torch.float32:
        log.info("encoding on the CPU in %s: seconds per prompt for a large encoder", dtype_name(dtype))
    encoders = {}
    for model in settings.prewarmer_models or [settings.default_model]:
        encoder = build_text_encoder(model, device=device, dtype=dtype, model_dir=settings.model_dir)
        encoders[(model, dtype_name(dtype))] = encoder
        log.info("text encoder loaded", extra={"model": model, "device": str(device), "dtype": dtype_name(dtype)})
    return encoders


class Prewarmer:
    def __init__(
        self,
        settings: Settings,
        *,
        encoders: dict[tuple[str, str], TextEncoder],
        cache: EmbeddingCache | None = None,
        control: redis.Redis | None = None,
        queued: Callable[[int], Sequence[QueuedPrompts]] | None = None,  # given up to this many per queue
        clock: Callable[[], float] = time.time,
        between_batches: Callable[[], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.encoders = encoders
        self.by_model = {model: e for (model, _), e in encoders.items()}
        self.cache = cache or build_cache(settings, l1=False, flusher=False)
        self.control = control or control_client(settings)
        self.blocking = control_client(settings, blocking_s=settings.prewarmer_interval_s)
        self.prefix = settings.broker_key_prefix
        self.queued = queued or self._queued_from_broker
        self.clock = clock
        # Called between batches (run_forever touches the liveness file there); False stops the cycle early.
        self.between_batches = between_batches or (lambda: True)
        self.monitor = HitRateMonitor(
            threshold=settings.cache_hit_rate_threshold,
            low_windows=settings.cache_low_windows,
            recover_windows=settings.cache_recover_windows,
            min_lookups=settings.cache_monitor_min_lookups,
            tiers=settings.cache_monitored_tiers,
        )
        self._recent: dict[str, float] = {}  # keys known to be in L2, until this time (saves EXISTS calls)

    @property
    def compensating(self) -> bool:
        return self.monitor.mode == "compensating"

    # --- 1. requests of encoder-free workers ---------------------------------------------------------------------

    def serve_requests(self, *, wait_s: float = 0.0, limit: int = 64) -> int:
        """Answer pending encode requests (waiting up to ``wait_s`` for the first); returns how many."""
        served = 0
        while served < limit:
            client = self.blocking if wait_s > 0 else self.control
            request = take_request(client, prefix=self.prefix, timeout_s=wait_s if served == 0 else 0)
            if request is None:
                break
            served += 1
            self._answer(request)
        return served

    def _answer(self, request: EncodeRequest) -> None:
        with stage_span("encode_request", {"vidq.model": request.model, "vidq.texts": len(request.texts)}):
            self._answer_traced(request)

    def _answer_traced(self, request: EncodeRequest) -> None:
        if request.deadline < self.clock():
            REQUESTS.labels("expired").inc()
            return  # nobody waits for it any more
        encoder = self.encoders.get((request.model, request.dtype))
        if encoder is None or encoder.identity.fingerprint != request.fingerprint:
            REQUESTS.labels("unsupported").inc()
            loaded = sorted(f"{m} ({d})" for m, d in self.encoders)
            reply(
                self.control,
                request,
                entries=None,
                error=f"{request.model} ({request.dtype}) is not loaded here with that configuration; loaded: {loaded}",
            )
            return
        identity = encoder.identity
        keys = [identity.key(t) for t in request.texts]
        try:
            rows = encoder.encode(list(request.texts), batch_size=self._batch())
        except Exception as exc:  # out of memory, a broken encoder: the worker hears it now, not at its timeout
            REQUESTS.labels("failed").inc()
            log.exception("encode request failed", extra={"model": request.model})
            reply(self.control, request, entries=None, error=f"encoding failed: {type(exc).__name__}: {exc}"[:500])
            return
        ENCODED.labels("request").inc(len(rows))
        payloads = [pack(k, r) for k, r in zip(keys, rows, strict=True)]
        reply(self.control, request, entries=payloads)
        REQUESTS.labels("answered").inc()
        self._store(dict(zip(keys, payloads, strict=True)))

    # --- 2. monitors ---------------------------------------------------------------------------------------------

    def check_monitors(self) -> str:
        s = self.settings
        windows = read_windows(
            self.control,
            prefix=self.prefix,
            window_s=s.cache_window_s,
            count=max(s.cache_low_windows, s.cache_recover_windows) + 1,
            now=self.clock(),
        )
        if windows:
            last = windows[-1]
            for tier in RATES:
                rate = last.tier(tier).rate
                if rate is not None:
                    HIT_RATE.labels(tier).set(rate)
        change = self.monitor.observe(windows)
        if change is not None:
            MODE_CHANGES.labels(change.mode).inc()
            level = logging.WARNING if change.mode == "compensating" else logging.INFO
            log.log(level, f"cache mode: {change.mode}", extra={"mode": change.mode, "reason": change.reason})
        MODE.set(1 if self.compensating else 0)
        try:
            self.control.set(mode_key(self.prefix), self.monitor.mode, ex=max(60, int(10 * s.cache_window_s)))
        except redis.RedisError:
            log.warning("could not publish the cache mode", exc_info=True)
        return self.monitor.mode

    # --- 3. prewarm ----------------------------------------------------------------------------------------------

    def _batch(self) -> int:
        return self.settings.prewarmer_concurrency * (2 if self.compensating else 1)

    def _queued_from_broker(self, per_queue: int) -> Sequence[QueuedPrompts]:
        """Up to ``per_queue`` jobs of each video queue of every pool with a live worker (stable's always), queue by
        queue in the workers' order, newest first."""
        pools = sorted(set(live_workers_or_none(self.control, self.settings) or {}) - {STABLE_POOL})
        ids = [
            job_id
            for pool in (STABLE_POOL, *pools)
            for queue in video_queues(pool)
            for job_id in peek_job_ids(
                self.control, prefix=self.prefix, queues=[queue], limit=per_queue, order="newest"
            )
        ]
        return queued_prompts(self.settings, ids)

    def candidates(self, report: CycleReport) -> list[Candidate]:
        s = self.settings
        scale = 2 if self.compensating else 1
        queued: list[Candidate] = []
        for job in self.queued(s.prewarmer_scan_jobs):
            encoder = self.by_model.get(job.model)
            if encoder is None:
                report.skipped_models.add(job.model)
                continue
            queued.extend(Candidate(encoder.identity, encoder.identity.key(t), t, "queued") for t in job.texts)
        hot: list[Candidate] = []
        for prompt in self.cache.hot.hottest(s.prewarmer_hot_per_cycle * scale):
            encoder = self.encoders.get((prompt.model, prompt.dtype))
            if encoder is not None and encoder.identity.key(prompt.text) == prompt.key:
                hot.append(Candidate(encoder.identity, prompt.key, prompt.text, "hot"))
        ordered = [*hot, *queued] if self.compensating else [*queued, *hot]
        seen: set[str] = set()
        now = self.clock()
        out = []
        for c in ordered:
            if c.key not in seen and self._recent.get(c.key, 0.0) <= now:
                seen.add(c.key)
                out.append(c)
        return out

    def prewarm(self, candidates: Iterable[Candidate], report: CycleReport) -> None:
        pending = list(candidates)
        batch = self._batch()
        for start in range(0, len(pending), batch):
            chunk = pending[start : start + batch]
            self._prewarm_chunk(chunk, report)
            report.requests += self.serve_requests()  # workers never wait behind a whole cycle
            if not self.between_batches():
                return  # stopping: the rest waits for the next start

    def _prewarm_chunk(self, chunk: list[Candidate], report: CycleReport) -> None:
        l2, l3 = self.cache.l2, self.cache.l3
        first = l2 or l3  # the tier workers look in first after their own L1
        if first is None:
            return  # no shared tier to fill (both "off"): the prewarmer only answers encode requests
        keys = [c.key for c in chunk]
        try:
            present = first.existing(keys)
        except TierDown:
            return  # nothing to fill: the workers encode meanwhile
        self._remember(present)
        missing = [c for c in chunk if c.key not in present]
        if not missing:
            return
        with stage_span("prewarm", {"vidq.candidates": len(chunk), "vidq.missing": len(missing)}):
            self._fill(missing, report)

    def _fill(self, missing: list[Candidate], report: CycleReport) -> None:
        """What the first shared tier lacks: promoted from L3 when it holds it, else encoded; written to L2 and L3."""
        l2, l3 = self.cache.l2, self.cache.l3
        from_l3: dict[str, bytes] = {}
        if l3 is not None and l2 is not None:
            try:
                from_l3 = {k: v for k, v in l3.get_many([c.key for c in missing]).items() if v is not None}
            except TierDown:
                from_l3 = {}
        if from_l3 and l2 is not None:
            try:
                l2.put_many(from_l3)
                report.promoted += len(from_l3)
                PROMOTED.inc(len(from_l3))
                self._remember(from_l3)
            except TierDown:
                pass
        to_encode = [c for c in missing if c.key not in from_l3]
        by_identity: dict[EncoderIdentity, list[Candidate]] = {}
        for c in to_encode:
            by_identity.setdefault(c.identity, []).append(c)
        for identity, items in by_identity.items():
            encoder = self.encoders[(identity.model, identity.dtype)]
            rows = encoder.encode([c.text for c in items], batch_size=self._batch())
            for c in items:
                ENCODED.labels(c.source).inc()
            report.encoded += len(rows)
            self._store({c.key: pack(c.key, r) for c, r in zip(items, rows, strict=True)})

    def _store(self, payloads: dict[str, bytes]) -> None:
        self.cache.store_shared(payloads, core=True)  # the prewarmer's keys are core: normal TTLs
        self._remember(payloads)

    def _remember(self, keys: Iterable[str]) -> None:
        until = self.clock() + min(60.0, self.settings.cache_l2_ttl_s / 2)
        for key in keys:
            self._recent[key] = until
        if len(self._recent) > 4 * self.settings.cache_hot_max:
            now = self.clock()
            self._recent = {k: t for k, t in self._recent.items() if t > now}

    # --- the loop ------------------------------------------------------------------------------------------------

    def cycle(self) -> CycleReport:
        started = time.perf_counter()
        report = CycleReport()
        report.requests += self.serve_requests()
        report.mode = self.check_monitors()
        self.cache.hot.maintain(now=self.clock())
        candidates = self.candidates(report)
        report.candidates = len(candidates)
        self.prewarm(candidates, report)
        CYCLE.observe(time.perf_counter() - started)
        return report

    def run_forever(self, stop: threading.Event) -> None:
        from shared.infra.liveness import touch

        alive = Path(self.settings.prewarmer_liveness_file)

        def between_batches() -> bool:
            # A long cycle (a deep backlog of new prompts, a large encoder on a CPU) still shows it is alive, and a
            # SIGTERM stops it after the batch in hand.
            with contextlib.suppress(OSError):
                touch(alive)
            return not stop.is_set()

        self.between_batches = between_batches
        while not stop.is_set():
            try:
                report = self.cycle()
                if report.encoded or report.promoted or report.skipped_models:
                    log.info("prewarm cycle", extra=report.as_dict())
            except (redis.RedisError, OSError) as exc:
                log.warning("prewarm cycle failed; retrying next cycle", extra={"error": repr(exc)[:300]})
            except Exception:
                log.exception("prewarm cycle failed")
            try:
                touch(alive)
            except OSError as exc:
                log.warning("liveness file not writable", extra={"path": str(alive), "error": str(exc)})
            # The wait between cycles is spent answering workers as their requests arrive.
            deadline = time.monotonic() + self.settings.prewarmer_interval_s
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                try:
                    self.serve_requests(wait_s=min(left, 1.0))
                except (redis.RedisError, OSError) as exc:
                    log.warning("could not read encode requests", extra={"error": repr(exc)[:300]})
                    stop.wait(min(left, 1.0))
