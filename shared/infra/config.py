"""vidq settings: the one place that reads the environment (prefix ``VIDQ_``).

Every number from the design (score weights, thresholds, leases, caps) is a setting here, not a constant in code.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, PostgresDsn, RedisDsn, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.queues import POOL_NAME
from shared.spec import Precision, parse_shape

MonitoredTier = Literal["overall", "l1", "l2", "l3"]
PLACEHOLDER_SECRETS = {"", "change-me", "dev", "minioadmin", "secret"}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VIDQ_", env_file=".env", extra="ignore")

    env: Literal["dev", "test", "prod"] = "dev"
    log_level: str = "INFO"
    log_json: bool = True

    # --- connections -------------------------------------------------------------------------------------------
    database_url: PostgresDsn = PostgresDsn("postgresql+psycopg://postgres@127.0.0.1:5432/vidq")
    db_connect_timeout_s: int = 5
    db_statement_timeout_ms: int = 15_000
    # Connections per process. The API admits at most this many requests at once (VIDQ_API_MAX_INFLIGHT defaults
    # to it), so a request never waits for a connection while holding one: pools and concurrency are sized together.
    db_pool_size: int = 10
    db_pool_timeout_s: float = 5.0
    db_pool_recycle_s: int = 1800
    # The API's async pool retries a lost connection with a doubling delay for at most this long, then lets the next
    # request connect at once: after an outage the API answers again within about this long.
    db_pool_reconnect_s: float = 5.0
    broker_url: RedisDsn = RedisDsn("redis://127.0.0.1:6379/0")
    redis_socket_timeout_s: float = 5.0
    # Every Redis key the broker writes starts with this (queues, unacked, bindings, event channels), so several
    # stacks (or test sessions) can share one Redis database without seeing each other's messages.
    broker_key_prefix: str = ""

    s3_endpoint: str = "127.0.0.1:8333"
    s3_secure: bool = False
    s3_access_key: str = "vidq"
    s3_secret_key: str = "vidq-dev-secret"
    s3_region: str = "us-east-1"
    s3_bucket: str = "vidq"
    s3_timeout_s: float = 30.0
    # Where clients reach S3, when it differs from VIDQ_S3_ENDPOINT (a cluster-internal name): presigned URLs are
    # signed for this host. Empty = the same as s3_endpoint.
    s3_public_endpoint: str = ""
    s3_public_secure: bool | None = None  # None = same as s3_secure
    presign_expiry_s: int = 3600

    # --- API ----------------------------------------------------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_workers: int = 1  # processes (`vidq api --workers N`); each has its own pool of db_pool_size connections
    # Load shedding: at most this many requests are handled at once per process (0 = db_pool_size); the next ones
    # wait up to api_queue_timeout_s for a slot, then get 503 + Retry-After. Progress streams are not counted.
    api_max_inflight: int = 0
    # Requests that may wait for a slot at once (0 = as many as the slots serve within api_queue_timeout_s, from the
    # measured time a request holds its slot); past that a request is refused at once.
    api_max_queued: int = 0
    api_queue_timeout_s: float = 0.5
    api_retry_after_s: int = 1
    api_key_cache_s: float = 10.0  # an API key's tenant is remembered this long (a revoked key works ≤ this long)
    # One log line per request (uvicorn's access log). Off by default: the line costs about as much CPU as refusing
    # the request, and the requests' counts and latencies are in the metrics.
    api_access_log: bool = False
    public_base_url: str = "http://127.0.0.1:8000"
    page_size_max: int = 100
    # A progress stream (SSE) follows the worker's Redis pub/sub messages; after this long without one it reads the
    # job from Postgres anyway, so a lost message (a Redis restart; the sweeper's recoveries publish none) cannot
    # leave it hanging.
    events_resync_s: float = 30.0
    events_max_s: float = 3600.0  # a stream ends after this; clients reconnect
    readyz_timeout_s: float = 3.0
    idempotency_ttl_s: int = 24 * 3600
    # The result cache reuses a stored video only if S3 confirms it is there (one HEAD) within this long; else renders.
    result_cache_check_timeout_s: float = 2.0

    # --- validation caps (the GPU never sees a request it would reject) -------------------------------------
    max_prompt_chars: int = 2000
    max_duration_s: float = 10.0
    max_fps: int = 30
    min_fps: int = 4
    max_width: int = 1920
    max_height: int = 1920
    max_pixels: int = 1280 * 720
    max_frames: int = 241
    max_steps: int = 100
    max_guidance_scale: float = 20.0
    max_metadata_bytes: int = 4096
    models_allowed: list[str] = Field(default_factory=lambda: ["tiny-wan", "wan2.1-1.3b-arch"])
    default_model: str = "tiny-wan"

    # --- priority score (docs/architecture.md) ------------------------------------------------------------------
    score_weight_complexity: float = 0.40
    score_weight_resolution: float = 0.35
    score_weight_duration: float = 0.25
    score_node_norm: int = 200
    score_high: float = 0.8
    score_medium: float = 0.5
    # Anti-starvation: a job waiting longer than this in its queue is re-sent one class up (services/sweeper).
    aging_promote_after_s: float = 300.0

    # --- reliability --------------------------------------------------------------------------------------------
    max_attempts: int = 3
    lease_s: float = 60.0
    heartbeat_s: float = 10.0
    enqueue_grace_s: float = 10.0  # a queued job never sent is re-sent after this
    queued_resend_s: float = 1800.0  # a sent job nobody claimed is re-sent after this (lost message)
    sweep_interval_s: float = 5.0
    # The sweeper is its own process, `vidq sweep --forever` (compose's `sweeper`, k8s' vidq-sweeper, `vidq up`).
    # True also runs it as a thread of every API process; any number of sweepers is safe (one acts at a time,
    # under a Postgres advisory lock), but then every API replica spends database connections on it.
    sweeper_in_api: bool = False
    sweeper_liveness_file: str = "/tmp/vidq-sweeper-alive"  # touched after every tick, failed ones included
    # `vidq sweep-alive` fails when that file is older than this; 0 = max(60 s, 6 × sweep_interval_s).
    sweeper_liveness_max_age_s: float = 0.0

    # --- scheduling (shared/jobs/fairness.py, services/api/scheduling/) ----------------------------------------
    # Fair share inside a class: a tenant's weight by tenant name (JSON, e.g. {"acme": 3}); absent = 1. A tenant of
    # weight 3 gets three turns for every one of a tenant of weight 1 while both have jobs waiting in the class.
    fair_share_weights: dict[str, float] = Field(default_factory=dict)
    # Admission watermark (shared/scheduling/watermark.py): a submit that would take its class's backlog past W is
    # refused (429 + Retry-After). W moves each cycle toward watermark_idle while the GPUs' mean utilisation is under
    # watermark_util_idle, watermark_busy while it is over watermark_util_busy, else watermark_normal; by at most
    # watermark_max_change of itself per cycle, within [watermark_min, watermark_max].
    watermark_enabled: bool = True
    watermark_idle: int = Field(default=64, ge=1)
    watermark_normal: int = Field(default=128, ge=1)
    watermark_busy: int = Field(default=512, ge=1)
    watermark_min: int = Field(default=32, ge=1)
    watermark_max: int = Field(default=512, ge=1)
    watermark_util_idle: float = Field(default=0.30, ge=0, le=1)
    watermark_util_busy: float = Field(default=0.85, ge=0, le=1)
    watermark_max_change: float = Field(default=0.25, gt=0, le=1)
    scheduling_cycle_s: float = Field(default=1.0, ge=0)  # the stepper's period, fleet-wide
    scheduling_sample_s: float = Field(default=0.2, gt=0)  # each worker samples its GPU this often
    scheduling_util_alpha: float = Field(default=0.3, gt=0, le=1)  # EWMA weight of a new utilisation sample
    scheduling_util_stale_s: float = Field(default=5.0, gt=0)  # a worker silent this long is no longer averaged
    scheduling_rate_alpha: float = Field(default=0.1, gt=0, le=1)  # EWMA weight of a cycle's service rate
    # An admitted job counts in its class's backlog from its admission until its message is on the queue; one whose
    # message is never published (its insert failed, the broker is down) stops counting after this long.
    scheduling_reserve_s: float = Field(default=10.0, gt=0)
    scheduling_retry_after_max_s: int = Field(default=300, ge=1)
    # Each submit asks Redis once, within this long; when that fails, admission stays open (no check) for
    # scheduling_redis_backoff_s before it asks again: an outage of the scheduling Redis costs no submit its answer.
    scheduling_redis_timeout_s: float = Field(default=0.25, gt=0)
    scheduling_redis_backoff_s: float = Field(default=5.0, ge=0)
    # Dynamic batching (services/worker/batching.py): the JSON table benchmarks/batching.py writes for the workers'
    # kind of device; auto: the one vidq ships for the worker's GPU (services/worker/batch_tables/), none on the CPU;
    # empty: every job renders alone. After its claim a worker waits for compatible jobs of the
    # class: high not at all, medium from batch_window_medium_min_s up to _max_s as its queue grows, low until the
    # batch is full or batch_window_low_s; it looks every batch_poll_s.
    worker_batch_table: str = "auto"
    batch_window_medium_min_s: float = Field(default=0.128, ge=0)
    batch_window_medium_max_s: float = Field(default=0.512, ge=0)
    batch_window_low_s: float = Field(default=1.0, ge=0)
    batch_poll_s: float = Field(default=0.05, gt=0)
    # ETA quotes (services/api/jobs/estimates.py): each API process re-reads the queues and the measured render
    # costs this often; the last eta_samples renders of each model and shape are kept.
    eta_refresh_s: float = Field(default=1.0, gt=0)
    eta_samples: int = Field(default=50, ge=1)
    # A refresh reads at most this many queued jobs (the oldest); the rest count as typical jobs, all ahead.
    eta_max_jobs: int = Field(default=2000, ge=1)

    # --- worker -------------------------------------------------------------------------------------------------
    worker_preload_models: list[str] = Field(default_factory=list)  # built in worker_process_init
    # CPUs the worker runs on, comma-separated ("" = all it has); `vidq worker --gpus` sets each worker's to its GPU's
    # NUMA node.
    worker_cpu_affinity: str = ""
    task_soft_time_limit_s: int = 1800
    task_time_limit_s: int = 1900
    visibility_timeout_s: int = 7200
    # Postgres unreachable at a worker's claim or finalize: retry after base, ×2 each time up to max, each delay
    # × a random factor in [0.5, 1], so a recovered database sees the job within about max seconds.
    worker_db_retry_base_s: float = 0.1
    worker_db_retry_max_s: float = 1.0
    # How long a worker holds an unclaimable message (the database down) before it re-publishes it to its queue
    # and takes the next; keep it well below task_soft_time_limit_s, which would otherwise stop the wait.
    worker_claim_wait_s: float = 300.0
    # An S3 outage up to this long delays the upload (retried with the same backoff) instead of spending an attempt.
    worker_upload_retry_s: float = 300.0
    progress_min_interval_s: float = 0.5
    worker_metrics_port: int = 9808  # Prometheus /metrics of a worker (0 = off)
    worker_liveness_file: str = "/tmp/vidq-worker-alive"  # touched by the worker's consumer loop
    worker_liveness_max_age_s: float = 60.0
    # A pool process builds its models in a background thread (no start-up timeout applies there); past this long
    # still loading it counts as stuck: `vidq worker-alive` fails and a task waiting for it gives its message back.
    worker_model_load_timeout_s: float = 600.0
    worker_model_load_delay_s: float = 0.0  # test knob only: sleep this long before building the models
    # First SIGTERM: the running job gets this long to finish, then the pool is killed (a second SIGTERM: at once).
    # Keep it above task_time_limit_s and below the orchestrator's grace (compose stop_grace_period, k8s
    # terminationGracePeriodSeconds).
    worker_shutdown_grace_s: float = 1950.0
    model_dir: str | None = None  # local diffusers folder served as model "local"
    device: str | None = None  # "cuda", "cpu"; None = cuda if available
    cuda_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    # The precision tier a worker renders a job in when the job names none (a job's own `precision` wins): exact
    # (bf16 with kernels that keep the math) or fast (8-bit matrix products: fp8 where the GPU has it, else int8
    # weights).
    worker_precision: Precision = "exact"
    # Compile the transformer's blocks (torch.compile): auto = on CUDA only (on the CPU a compile costs minutes and
    # gains little); on; off. Compiled kernels persist in worker_compile_cache_dir, so a restarted worker on the same
    # machine loads them instead of compiling again.
    worker_compile: Literal["auto", "on", "off"] = "auto"
    worker_compile_cache_dir: str = "~/.cache/vidq/compile"
    # Shapes (HEIGHTxWIDTHxFRAMES, e.g. ["480x832x33","480x832x81"]) every preloaded model renders once at start, with
    # classifier-free guidance, before the worker reports ready: their kernels are compiled (or loaded from the cache)
    # then, so the first job of such a shape pays no compile. A job of another shape compiles first (logged).
    worker_warmup_shapes: list[str] = Field(default_factory=list)
    # resident: every weight stays on the GPU. low_vram: the transformer and text encoder stay in CPU RAM and are
    # streamed to the GPU block by block (diffusers group offloading on a side stream); the VAE decodes a video whole
    # when the decode's estimated peak fits the free GPU memory, in tiles (slower, far less memory) when it does not
    # (shared/render/memory.py). A resident worker that runs out of GPU memory retries the job once in low_vram and
    # keeps that model there.
    worker_memory_mode: Literal["resident", "low_vram"] = "resident"
    # At most this many MiB for a low_vram decode decoding whole (a video whose estimated decode needs more decodes
    # in tiles), below the free GPU memory less a margin; 0 = the free memory alone. A cap keeps a low_vram worker's
    # peak down where other processes share its GPU.
    worker_low_vram_decode_budget_mb: int = Field(default=0, ge=0)
    # The VRAM pool (shared/render/pool.py): the pipelines a worker keeps on its device. 0 = no budget / no limit.
    vram_pool_budget_mb: int = 0
    vram_pool_max_models: int = 0
    vram_pool_eviction: Literal["lru", "priority"] = "lru"
    vram_pool_priorities: dict[str, int] = Field(default_factory=dict)  # model → priority: higher stays longer
    # Evicted resident pipelines wait in CPU RAM up to this many MiB (coming back is a copy, not a rebuild); 0 = drop.
    vram_pool_host_budget_mb: int = 16384
    # Test knob only: the next this-many renders of each pool process raise a real torch.OutOfMemoryError.
    worker_fault_oom_renders: int = 0
    # Test knob only: while this file exists, a render holds after each denoising step (its progress recorded) until
    # the file is gone or the job is cancelled, so a test acts on a job that is surely mid-render. Empty = never.
    worker_fault_hold_file: str = ""
    # Test knob only: the context step (what a finished video is about) raises instead of describing the video.
    worker_fault_context: bool = False
    # Test knob only: while this file exists, a job's upload waits before it starts (its lease renewed, a cancel
    # seen), so a test acts on a job that is surely being finished. Empty = never.
    worker_fault_hold_upload_file: str = ""
    # A rendered job's end (MP4 encode, poster, upload, finalize, webhook, context) runs on a thread of its own while
    # the next job renders, so the GPU never waits for it (services/worker/finisher.py); off: the task does it before
    # it takes the next job. Depth: how many rendered jobs may wait behind the one being finished before a render
    # waits to hand its frames over (each holds its frames in memory meanwhile).
    worker_overlap: bool = True
    worker_overlap_depth: int = Field(default=1, ge=1)
    # What a finished video is about (keyframe embedding, motion): described by the worker after the job has
    # succeeded. Off: no video is described (similar-video search and motion filters find nothing new).
    context_enabled: bool = True
    # The motion prototypes' refit (`vidq motion-refit`, the deploy's periodic job): how many sets to keep, so
    # assignments of older sets stay readable for a while.
    motion_sets_kept: int = Field(default=5, ge=1)
    # local: the worker loads the model's text encoder and encodes what no cache tier holds. remote: it never loads
    # the encoder (UMT5-XXL is ≈ 11 GiB of VRAM); what no tier holds it asks the prewarmer for.
    worker_text_encoder: Literal["local", "remote"] = "local"
    # remote: how long a worker waits for the prewarmer's answer before it gives the job back (retryable).
    worker_remote_encode_timeout_s: float = 30.0

    # --- text-embedding cache (shared/textcache) ------------------------------------------------------------
    cache_enabled: bool = True  # false: every job encodes its prompts, nothing is looked up or stored
    cache_l1_max_bytes: int = 512 * 1024 * 1024  # each worker's in-process LRU, by tensor bytes
    # L2 (hot, small, short TTL; may be node-local) and L3 (warm, large, long TTL, compressed) Redis URLs. Empty:
    # the broker's Redis, under the broker key prefix. "off": the tier is not used.
    cache_l2_url: str = ""
    cache_l3_url: str = ""
    cache_l2_ttl_s: int = 3600
    cache_l3_ttl_s: int = 7 * 24 * 3600
    cache_l3_zstd_level: int = 3
    cache_redis_timeout_s: float = 0.5  # one cache call; a slow or dead tier must not hold a job up
    cache_tier_backoff_s: float = 10.0  # a tier whose call failed is skipped this long (then tried again)
    # Forward prewarm: an L2 hit also pulls the prompts of the next this-many queued jobs from L2/L3 into L1.
    cache_forward_jobs: int = 3
    # Hit-rate monitors: lookups counted per tier in windows of this many seconds, cluster-wide (broker Redis).
    cache_window_s: float = 10.0
    cache_window_retention_s: int = 3600
    cache_hit_rate_threshold: float = 0.85
    cache_low_windows: int = 3  # windows in a row below the threshold that start cold-start compensation
    cache_recover_windows: int = 1  # windows in a row at or above it (every tier) that end it
    cache_monitor_min_lookups: int = 20  # a window with fewer lookups at a tier says nothing about that tier
    # What the monitors judge: "overall" (served by any tier) and/or one level, "l1", "l2", "l3" (see monitor.py).
    cache_monitored_tiers: list[MonitoredTier] = Field(default_factory=lambda: list[MonitoredTier](["overall"]))
    # Compensation: what workers write to L2 that is not core (the hottest cache_core_keys prompts) lives this long.
    cache_compensation_l2_ttl_s: int = 30
    cache_core_keys: int = 1000
    # The frequency sketch of prompts (top-K with decay, in the broker Redis): its size and its half-life.
    cache_hot_max: int = 10_000
    cache_hot_half_life_s: float = 3600.0

    # --- prewarmer (services/prewarmer) -------------------------------------------------------------------------
    prewarmer_models: list[str] = Field(default_factory=list)  # whose encoders it loads; empty = default_model
    prewarmer_device: str | None = None  # "cuda", "cpu"; None = cuda if available
    # The dtype it encodes in: the workers' compute dtype (a CPU prewarmer for bf16 GPU workers sets bfloat16).
    # Unset: what a worker on this machine would use (settings.device and cuda_dtype).
    prewarmer_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    prewarmer_interval_s: float = 1.0  # a cycle: answer workers, scan the queues, refill hot prompts
    prewarmer_concurrency: int = 8  # prompts encoded per batch (×2 in compensation)
    prewarmer_scan_jobs: int = 256  # queued jobs read per queue per cycle
    prewarmer_hot_per_cycle: int = 64  # hottest prompts checked per cycle (×2 in compensation)
    prewarmer_metrics_port: int = 9810  # Prometheus /metrics of the prewarmer (0 = off)
    prewarmer_liveness_file: str = "/tmp/vidq-prewarmer-alive"  # touched after every cycle
    prewarmer_liveness_max_age_s: float = 120.0

    # --- webhooks -----------------------------------------------------------------------------------------------
    webhook_timeout_s: float = 10.0
    # Delays after failed attempts 1, 2, …; attempt 1 is immediate, the last one is followed by none (gave_up).
    # Standard Webhooks / Svix: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h (8 attempts over about 28 h).
    webhook_schedule_s: list[float] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0]
    )
    webhook_schedule_jitter: float = Field(default=0.1, ge=0, le=1)  # each delay × a factor in [1 - this, 1 + this]
    webhook_resend_grace_s: float = 60.0  # a finished job with no delivery attempt after this is handed over again
    webhook_allow_private: bool = False  # loopback/private/link-local targets (tests and the demo only)

    # --- tracing (shared/infra/tracing.py) ---------------------------------------------------------------------------
    # OTLP/HTTP collector, e.g. http://otel-collector:4318 (…/v1/traces is added unless the URL ends with it).
    # Empty: tracing is off, no provider is installed and nothing is instrumented.
    otel_endpoint: str = ""
    otel_timeout_s: float = 5.0  # one export request, retries included; also bounds the flush at process exit
    otel_batch_delay_ms: int = 5000  # spans are exported in batches at least this often
    otel_sample_ratio: float = Field(default=1.0, ge=0, le=1)  # share of jobs (traces) recorded

    # --- worker pools and canary release (shared/pools) ------------------------------------------------------------
    # The pool this worker joins (`vidq worker --pool`): it consumes only that pool's queues (video.high.<pool> …;
    # the stable pool's are video.high …).
    worker_pool: str = "stable"
    # Each API process re-reads the routing rules (pools, splits, tenant assignments) from Postgres this often: a
    # change through `vidq pools` or /v1/admin/pools takes effect within it.
    pool_rules_refresh_s: float = Field(default=2.0, gt=0)
    # A worker announces its pool with every utilisation sample; a pool none of whose workers was heard from this
    # long has no live worker: it receives no new job (its share falls back to stable).
    pool_worker_stale_s: float = Field(default=15.0, gt=0)
    # The sweeper moves the queued jobs of a pool that has had no live worker this long to stable (a pool whose
    # workers restart, loading their model, keeps its jobs meanwhile).
    pool_reroute_after_s: float = Field(default=180.0, gt=0)
    # A pool's failure-rate breaker (the sweeper): at least pool_breaker_min_jobs jobs of the pool finished within
    # pool_breaker_window_s and at least pool_breaker_failure_ratio of them failed → the pool is taken out of
    # routing (state tripped) and its queued jobs go to stable; an operator puts it back (`vidq pools set-split`).
    pool_breaker_window_s: float = Field(default=600.0, gt=0)
    pool_breaker_min_jobs: int = Field(default=20, ge=1)
    pool_breaker_failure_ratio: float = Field(default=0.5, gt=0, le=1)

    # --- operators ----------------------------------------------------------------------------------------------
    # Bearer token of the operator endpoints (/v1/admin/…: cache statistics). Empty: those endpoints answer 404.
    admin_token: str = ""

    # --- fault isolation: circuit breakers, retries, degraded rendering ------------------------------------------
    # Circuit breakers (shared/infra/breakers.py), one per dependency and per process: open when at least
    # breaker_failure_ratio of at least breaker_min_calls calls within breaker_window_s failed; refuse calls for
    # breaker_open_s; then let one probe through (success closes, failure opens again).
    breaker_failure_ratio: float = Field(default=0.5, gt=0, le=1)
    breaker_min_calls: int = Field(default=20, ge=1)
    breaker_window_s: float = Field(default=60.0, gt=0)
    breaker_open_s: float = Field(default=60.0, gt=0)
    # Breakers kept per kind (webhook hosts, model+shape) in a process; the least recently used beyond this go.
    breaker_max_keys: int = Field(default=1000, ge=1)
    # Retries of single external calls (shared/infra/retries.py): from retry_base_s, ×2, at most retry_max_s,
    # full jitter; at most this many retries for idempotent work (S3 reads) and for non-idempotent (webhook POST).
    retry_base_s: float = Field(default=0.1, gt=0)
    retry_max_s: float = Field(default=1.0, gt=0)
    retry_idempotent_max: int = Field(default=3, ge=0)
    retry_non_idempotent_max: int = Field(default=2, ge=0)
    # Degraded rendering (shared/render/degrade.py): a job with allow_degraded renders at the next lower tier when
    # its model+shape breaker is open or it runs out of GPU memory: steps × this (at least 1), each side × this
    # (rounded down to the model's multiple of 16, at least 16).
    degrade_steps_factor: float = Field(default=0.5, gt=0, lt=1)
    degrade_side_factor: float = Field(default=0.5, gt=0, lt=1)

    @model_validator(mode="after")
    def _watermark_levels(self) -> Settings:
        levels = (self.watermark_idle, self.watermark_normal, self.watermark_busy)
        if not self.watermark_min <= self.watermark_max or not all(
            self.watermark_min <= w <= self.watermark_max for w in levels
        ):
            raise ValueError("watermark levels must lie within [VIDQ_WATERMARK_MIN, VIDQ_WATERMARK_MAX]")
        if self.watermark_util_idle > self.watermark_util_busy:
            raise ValueError("VIDQ_WATERMARK_UTIL_IDLE must not exceed VIDQ_WATERMARK_UTIL_BUSY")
        return self

    @field_validator("worker_pool")
    @classmethod
    def _pool(cls, pool: str) -> str:
        if not POOL_NAME.match(pool):
            raise ValueError(f"a pool name is 1-32 of a-z, 0-9 and '-', starting with a letter: {pool!r}")
        return pool

    @field_validator("fair_share_weights")
    @classmethod
    def _weights(cls, weights: dict[str, float]) -> dict[str, float]:
        if bad := {name: w for name, w in weights.items() if not w > 0}:
            raise ValueError(f"fair-share weights must be > 0: {bad}")
        return weights

    @field_validator("worker_warmup_shapes")
    @classmethod
    def _shapes(cls, shapes: list[str]) -> list[str]:
        for shape in shapes:
            parse_shape(shape)  # a typo fails at start, not after minutes of model loading
        return shapes

    @field_validator("device", "model_dir", "s3_public_secure", "prewarmer_device", "prewarmer_dtype", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # `VIDQ_DEVICE=` in an env file means "not set" (auto), not the empty string.
        return None if value == "" else value

    @model_validator(mode="after")
    def _refuse_placeholder_secrets(self) -> Settings:
        if self.env == "prod" and (
            self.s3_secret_key in PLACEHOLDER_SECRETS or self.s3_secret_key.endswith("-dev-secret")
        ):
            raise ValueError("VIDQ_S3_SECRET_KEY is a placeholder; set a real secret outside dev")
        return self

    @property
    def sqlalchemy_url(self) -> str:
        return str(self.database_url)

    @property
    def sweeper_liveness_max_age(self) -> float:
        """Seconds after which a sweeper that has not touched its liveness file counts as stuck."""
        return self.sweeper_liveness_max_age_s or max(60.0, 6 * self.sweep_interval_s)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
