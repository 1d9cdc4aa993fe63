"""The embedding cache against real Redis: promotion and write-through across L1/L2/L3, the forward prewarm of the
next queued jobs, corrupt entries, a Redis outage, compensation TTLs, the monitors' mode with a fake clock, the
hot-prompt sketch, remote encoding through the prewarmer, and identical frames with cached embeddings."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import redis
import torch

from services.prewarmer.service import MODE_CHANGES, Prewarmer
from services.worker.embeddings import _neighbours
from shared.celery_app import make_celery
from shared.config import Settings
from shared.render.registry import TINY_WAN, get_pipeline, pipeline_key
from shared.render.text import TextEncoder, build_text_encoder, texts_of
from shared.spec import GenerationSpec
from shared.textcache.codec import pack, unpack
from shared.textcache.factory import build_cache
from shared.textcache.hierarchy import EmbeddingCache
from shared.textcache.monitor import HitCounter, mode_key, read_windows
from shared.textcache.remote import EmbeddingsUnavailable, RemoteEncoder
from tests.integration.helpers import free_port, submit

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
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


def test_a_miss_everywhere_encodes_once_and_writes_through_every_tier(settings, clean_state, encoder):
    cache = new_cache(settings)
    encode = CountingEncoder(encoder)
    texts = ["a red fox in the snow", "ugly blurry"]
    rows = cache.get(encoder.identity, texts, encode)

    assert encode.calls == [texts]
    assert counts(cache) == {"l1:miss": 2, "l2:miss": 2, "l3:miss": 2}
    for text, got in zip(texts, rows, strict=True):
        key = encoder.identity.key(text)
        assert torch.equal(got, encoder.encode([text])[0])
        assert cache.l1 is not None and key in cache.l1
        assert torch.equal(stored(settings, "l2", key, encoder), got)  # L2 as it is: safetensors bytes
        l3 = raw(settings, "l3", key)
        assert l3 is not None and l3[:4] == b"\x28\xb5\x2f\xfd"  # L3 zstd-compressed
        assert 0 < ttl(settings, "l2", key) <= settings.cache_l2_ttl_s
        assert settings.cache_l2_ttl_s < ttl(settings, "l3", key) <= settings.cache_l3_ttl_s
    # Only the real tokens are stored: 7 rows (6 words and </s>) of 32 floats for this prompt, not 512.
    assert rows[0].shape == (7, 32)


def test_l2_hit_promotes_to_l1_and_l3_hit_promotes_to_l2_and_l1(settings, clean_state, encoder):
    text = "a small boat on a calm lake at sunset"
    key = encoder.identity.key(text)
    first = new_cache(settings)
    expected = first.get(encoder.identity, [text], encoder.encode)[0]

    never = CountingEncoder(encoder)
    second = new_cache(settings)  # another worker: its L1 is empty
    assert torch.equal(second.get(encoder.identity, [text], never)[0], expected)
    assert counts(second) == {"l1:miss": 1, "l2:hit": 1}
    assert second.l1 is not None and key in second.l1

    tier_redis(settings, "l2").delete(f"{settings.broker_key_prefix}vidq:emb:l2:{key}")
    third = new_cache(settings)
    assert torch.equal(third.get(encoder.identity, [text], never)[0], expected)
    assert counts(third) == {"l1:miss": 1, "l2:miss": 1, "l3:hit": 1}
    assert torch.equal(stored(settings, "l2", key, encoder), expected)  # back in L2
    assert third.l1 is not None and key in third.l1
    assert never.calls == []


def test_an_l2_hit_forward_prewarms_the_next_three_queued_jobs_into_l1(settings, client, encoder):
    # Five jobs wait in video.medium/low (no worker runs); their texts are in L2, put there by "another worker".
    jobs = [
        submit(client, prompt=f"a {color} bird flying over the sea", guidance_scale=5.0)
        for color in ("red", "blue", "green", "white", "black")
    ]
    filler = new_cache(settings)
    for job in jobs:
        filler.get(encoder.identity, list(texts_of(job["prompt"], job["negative_prompt"], 5.0)), encoder.encode)
    filler.get(encoder.identity, ["a quiet street at night"], encoder.encode)

    celery = make_celery(settings)
    worker = build_cache(settings, flusher=False, neighbours=lambda n: _neighbours(celery, n))
    worker.get(encoder.identity, ["a quiet street at night"], CountingEncoder(encoder))  # an L2 hit
    assert worker.forward_idle()

    # Workers take the oldest first (all five are in one class): the first three submitted are next.
    assert {job["priority_class"] for job in jobs} == {jobs[0]["priority_class"]}
    assert worker.l1 is not None
    in_l1 = {job["id"]: encoder.identity.key(job["prompt"]) in worker.l1 for job in jobs}
    assert in_l1 == {
        jobs[0]["id"]: True,
        jobs[1]["id"]: True,
        jobs[2]["id"]: True,
        jobs[3]["id"]: False,
        jobs[4]["id"]: False,
    }
    assert encoder.identity.key(jobs[0]["negative_prompt"]) in worker.l1
    assert counts(worker) == {"l1:miss": 1, "l2:hit": 1}  # the prefetch is not demand: not in the monitors


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "wrong-shape", "wrong-dtype", "other-key", "not-zstd"],
)
def test_corrupt_or_foreign_entries_are_ignored_deleted_and_re_encoded(settings, clean_state, encoder, damage):
    text = "a dog running on the beach"
    key = encoder.identity.key(text)
    good = encoder.encode([text])[0]
    bad = {
        "garbage": b"\x00" * 40,
        "truncated": pack(key, good)[:-7],
        "wrong-shape": pack(key, torch.zeros(3, 16)),
        "wrong-dtype": pack(key, good.to(torch.float16)),
        "other-key": pack(encoder.identity.key("another text"), good),
        "not-zstd": b"plain bytes in the compressed tier",
    }[damage]
    tier = "l3" if damage == "not-zstd" else "l2"
    tier_redis(settings, tier).set(f"{settings.broker_key_prefix}vidq:emb:{tier}:{key}", bad)

    cache = new_cache(settings, **({"cache_l2_url": "off"} if tier == "l3" else {}))  # L3 alone: no L2 in front
    encode = CountingEncoder(encoder)
    rows = cache.get(encoder.identity, [text], encode)

    assert torch.equal(rows[0], good)
    assert encode.calls == [[text]]
    assert counts(cache)[f"{tier}:miss"] == 1 and f"{tier}:hit" not in counts(cache)
    stored = raw(settings, tier, key)
    assert stored is not None and stored != bad  # replaced by the fresh, valid entry


def test_with_redis_down_a_lookup_encodes_and_the_dead_tier_is_skipped_for_its_backoff(settings, encoder):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    cache = new_cache(settings, cache_l2_url=dead, cache_l3_url=dead, cache_tier_backoff_s=60)
    encode = CountingEncoder(encoder)
    rows = cache.get(encoder.identity, ["a cat sleeping"], encode)
    assert torch.equal(rows[0], encoder.encode(["a cat sleeping"])[0])
    assert cache.l2 is not None and cache.l3 is not None
    assert not cache.l2.available and not cache.l3.available  # in back-off: the next lookups do not wait on them
    cache.get(encoder.identity, ["a dog sleeping"], encode)
    assert encode.calls == [["a cat sleeping"], ["a dog sleeping"]]


def test_in_compensation_what_workers_write_to_l2_lives_30_s_unless_it_is_core(settings, clean_state, encoder):
    client = redis.Redis.from_url(str(settings.broker_url))
    client.set(mode_key(settings.broker_key_prefix), "compensating")
    hot_text, cold_text = "a hot prompt everybody sends", "a cold prompt sent once"
    cache = new_cache(settings, cache_core_keys=1)
    cache.hot.note(encoder.identity.key(hot_text), model=TINY_WAN, dtype="float32", text=hot_text)
    pipe = client.pipeline()
    cache.hot.flush_step(pipe)
    pipe.execute()

    cache.get(encoder.identity, [hot_text, cold_text], encoder.encode)
    assert ttl(settings, "l2", encoder.identity.key(cold_text)) <= settings.cache_compensation_l2_ttl_s
    assert ttl(settings, "l2", encoder.identity.key(hot_text)) > settings.cache_compensation_l2_ttl_s


def write_window(settings: Settings, start: float, hits: int, misses: int) -> None:
    counter = HitCounter(
        redis.Redis.from_url(str(settings.broker_url)),
        prefix=settings.broker_key_prefix,
        window_s=settings.cache_window_s,
        retention_s=3600,
    )
    counter.record("l1", "hit", hits)
    counter.record("l1", "miss", misses)
    counter.flush(now=start + 1)


def test_three_low_windows_start_compensation_and_a_good_one_ends_it(settings, clean_state, caplog):
    window = settings.cache_window_s
    t0 = (time.time() // window - 1000) * window  # an hour ago, aligned: windows nobody else writes
    clock = {"now": t0}
    prewarmer = Prewarmer(settings, encoders={}, clock=lambda: clock["now"])
    changes = MODE_CHANGES.labels("compensating")._value.get()
    client = redis.Redis.from_url(str(settings.broker_url))

    def after(index: int, hits: int, misses: int) -> str:
        write_window(settings, t0 + index * window, hits, misses)
        clock["now"] = t0 + (index + 1) * window  # window `index` is now complete
        return prewarmer.check_monitors()

    assert after(0, 80, 20) == "normal"  # 80% < 85%: the first low window
    assert after(1, 10, 90) == "normal"  # the second
    assert after(2, 5, 15) == "compensating"  # the third (20 lookups: just enough to be judged)
    assert client.get(mode_key(settings.broker_key_prefix)) == b"compensating"
    assert MODE_CHANGES.labels("compensating")._value.get() == changes + 1
    assert after(3, 3, 2) == "compensating"  # 5 lookups: too few to judge, the mode holds
    assert after(4, 95, 5) == "normal"  # recovered
    assert client.get(mode_key(settings.broker_key_prefix)) == b"normal"
    assert any("cache mode: compensating" in r.getMessage() for r in caplog.records)


def test_compensation_doubles_the_batch_and_puts_hot_prompts_first(settings, clean_state, encoder):
    prewarmer = Prewarmer(settings, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: [])
    assert prewarmer._batch() == settings.prewarmer_concurrency
    prewarmer.monitor.mode = "compensating"
    assert prewarmer._batch() == 2 * settings.prewarmer_concurrency


def test_the_hot_sketch_decays_and_keeps_only_the_hottest(settings, clean_state):
    cache = new_cache(settings, cache_hot_max=2, cache_hot_half_life_s=10.0)
    hot = cache.hot
    for text, n in (("one", 1), ("two", 2), ("three", 3)):
        for _ in range(n):
            hot.note(f"k-{text}", model=TINY_WAN, dtype="float32", text=text)
    client = redis.Redis.from_url(str(settings.broker_url))
    pipe = client.pipeline()
    hot.flush_step(pipe)
    pipe.execute()

    hot.maintain(now=1000.0)
    assert [p.text for p in hot.hottest(5)] == ["three", "two"]  # "one" dropped: the sketch holds 2
    assert client.hget(hot.texts, "k-one") is None
    hot.maintain(now=1010.0)  # one half-life later
    assert client.zscore(hot.scores, "k-three") == pytest.approx(1.5)


@pytest.fixture
def prewarmer_thread(settings, encoder) -> Iterator[Prewarmer]:
    prewarmer = Prewarmer(settings, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: [])
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            prewarmer.serve_requests(wait_s=0.2)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield prewarmer
    stop.set()
    thread.join(5)


def remote(settings: Settings, timeout_s: float) -> RemoteEncoder:
    from shared.textcache.factory import control_client

    return RemoteEncoder(
        control_client(settings, blocking_s=timeout_s), prefix=settings.broker_key_prefix, timeout_s=timeout_s
    )


def test_remote_encoding_returns_what_the_local_encoder_gives_and_fills_l2_l3(
    settings, clean_state, encoder, prewarmer_thread
):
    texts = ["a horse in a field", "a horse in a field", ""]
    rows = remote(settings, 10).encode(encoder.identity, texts)
    for text, got in zip(texts, rows, strict=True):
        assert torch.equal(got, encoder.encode([text])[0])
        assert raw(settings, "l2", encoder.identity.key(text)) is not None


def test_remote_encoding_without_a_prewarmer_or_for_an_unloaded_model_is_unavailable(
    settings, clean_state, encoder, prewarmer_thread
):
    foreign = replace(encoder.identity, fingerprint="another-encoder")
    with pytest.raises(EmbeddingsUnavailable, match="not loaded here"):
        remote(settings, 10).encode(foreign, ["a tree"])


def test_remote_encoding_times_out_when_nobody_answers(settings, clean_state, encoder):
    started = time.monotonic()
    with pytest.raises(EmbeddingsUnavailable, match="no prewarmer answered"):
        remote(settings, 1).encode(encoder.identity, ["a tree"])
    assert time.monotonic() - started >= 1


def test_frames_are_identical_with_cached_and_freshly_encoded_embeddings(settings, clean_state):
    pipeline = get_pipeline(pipeline_key(TINY_WAN, device_pref="cpu", cuda_dtype="bfloat16"))
    spec = GenerationSpec(
        model=TINY_WAN,
        prompt="a red fox running",
        negative_prompt="blurry",
        width=32,
        height=32,
        num_frames=5,
        fps=8,
        steps=3,
        guidance_scale=5.0,
        seed=11,
    )
    plain = pipeline.generate(spec)  # the pipeline's own encoder, no cache
    writer = new_cache(settings)
    writer.get(pipeline.identity, list(texts_of(spec.prompt, spec.negative_prompt, 5.0)), pipeline.encode_texts)

    reader = new_cache(settings)  # another worker: served from L2, never encodes
    never = CountingEncoder(pipeline.encoder)  # type: ignore[arg-type]
    cached = pipeline.generate(spec, text_rows=lambda texts: reader.get(pipeline.identity, texts, never))
    assert never.calls == []
    assert counts(reader) == {"l1:miss": 2, "l2:hit": 2}
    assert np.array_equal(plain.frames, cached.frames)


def test_hit_counts_reach_the_cluster_windows(settings, clean_state, encoder):
    cache = new_cache(settings)
    cache.get(encoder.identity, ["a bear in the forest"], encoder.encode)
    cache.get(encoder.identity, ["a bear in the forest"], encoder.encode)
    now = time.time()
    cache.counter.flush(now=now)
    (window,) = read_windows(
        redis.Redis.from_url(str(settings.broker_url)),
        prefix=settings.broker_key_prefix,
        window_s=settings.cache_window_s,
        count=1,
        now=now + settings.cache_window_s,
    )
    assert window.tier("l1").hits == 1 and window.tier("l1").misses == 1
    assert window.overall.rate == 0.5


def test_a_failing_encoder_answers_the_worker_at_once_with_the_error(settings, clean_state, encoder):
    class Broken(TextEncoder):
        def encode(self, texts: list[str], *, batch_size: int = 1) -> list[torch.Tensor]:
            raise RuntimeError("CUDA out of memory")

    broken = Broken(encoder.tokenizer, encoder.encoder, identity=encoder.identity)
    prewarmer = Prewarmer(settings, encoders={(TINY_WAN, "float32"): broken}, queued=lambda n: [])
    thread = threading.Thread(target=prewarmer.serve_requests, kwargs={"wait_s": 5.0}, daemon=True)
    thread.start()
    # The prewarmer's answer (only its reply carries "encoding failed"), not the worker's 30 s timeout.
    with pytest.raises(EmbeddingsUnavailable, match="encoding failed: RuntimeError: CUDA out of memory"):
        remote(settings, 30).encode(encoder.identity, ["a tree"])
    thread.join(5)


def test_a_prewarm_cycle_fills_what_l2_lacks_promotes_from_l3_and_needs_a_tier(settings, clean_state, encoder):
    from shared.textcache.queued import QueuedPrompts

    jobs = [QueuedPrompts(uuid.uuid4(), TINY_WAN, (f"a {c} balloon in the sky", "blurry")) for c in ("red", "blue")]
    prewarmer = Prewarmer(settings, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: jobs)
    report = prewarmer.cycle()
    assert report.encoded == 3 and report.promoted == 0  # "blurry" once
    for text in ("a red balloon in the sky", "a blue balloon in the sky", "blurry"):
        key = encoder.identity.key(text)
        assert torch.equal(stored(settings, "l2", key, encoder), encoder.encode([text])[0])
        assert raw(settings, "l3", key) is not None

    # Gone from L2 (expired, evicted), still in L3: the next prewarmer copies it back without encoding.
    tier_redis(settings, "l2").delete(f"{settings.broker_key_prefix}vidq:emb:l2:{encoder.identity.key('blurry')}")
    again = Prewarmer(settings, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: jobs).cycle()
    assert (again.encoded, again.promoted) == (0, 1)
    assert raw(settings, "l2", encoder.identity.key("blurry")) is not None

    # No shared tier at all: nothing to fill, nothing encoded.
    off = settings.model_copy(update={"cache_l2_url": "off", "cache_l3_url": "off"})
    assert Prewarmer(off, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: jobs).cycle().encoded == 0
