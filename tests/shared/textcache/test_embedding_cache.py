"""The embedding cache (shared/textcache) in this process against real Redis: promotion and write-through across
L1/L2/L3, corrupt entries, a Redis outage, compensation TTLs, the hot-prompt sketch, the cluster's hit-count
windows, a remote encoding nobody answers, and identical frames with cached embeddings. Marked integration through
``settings``. The prewarmer's side: tests/services/prewarmer/test_embedding_cache.py; with a real API process:
tests/integration/test_embedding_cache.py."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import redis
import torch

from shared.render.registry import TINY_WAN, get_pipeline, pipeline_key
from shared.render.text import TextEncoder, texts_of
from shared.spec import GenerationSpec
from shared.textcache.codec import pack
from shared.textcache.monitor import mode_key, read_windows
from shared.textcache.remote import EmbeddingsUnavailable, requests_key
from tests.shared.textcache.helpers import (
    CountingEncoder,
    counts,
    new_cache,
    raw,
    remote,
    stored,
    tier_redis,
    tiny_encoder,
    ttl,
)
from tools.processes import free_ports


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return tiny_encoder()


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
    dead = f"redis://127.0.0.1:{free_ports(1)[0]}/0"
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


def test_remote_encoding_times_out_when_nobody_answers(settings, clean_state, encoder, monkeypatch):
    """No prewarmer runs: the request is sent, the worker waits its whole timeout on its reply list (Redis's
    BLPOP answers nil only once that timeout has passed), and the request is still there, untaken."""
    encoding = remote(settings, 1)
    waits: list[tuple[list[str], float, Any]] = []
    blpop = encoding.client.blpop

    def recorded_blpop(keys: list[str], timeout: float) -> Any:
        answer = blpop(keys, timeout=timeout)
        waits.append((list(keys), timeout, answer))
        return answer

    monkeypatch.setattr(encoding.client, "blpop", recorded_blpop)
    with pytest.raises(EmbeddingsUnavailable, match="no prewarmer answered"):
        encoding.encode(encoder.identity, ["a tree"])
    (pending,) = encoding.client.lrange(requests_key(settings.broker_key_prefix), 0, -1)
    request = json.loads(pending)
    assert request["texts"] == ["a tree"] and request["fingerprint"] == encoder.identity.fingerprint
    assert waits == [([request["reply_to"]], 1, None)]  # one wait, on this request's reply list, for 1 s: nothing


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
