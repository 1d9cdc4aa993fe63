"""The prewarmer (services/prewarmer) in this process against real Redis: the monitors' mode with a fake clock,
the compensation batch, remote encoding for encoder-free workers (answered, refused, failed), and a prewarm cycle
that fills L2/L3. Marked integration through ``settings``. The cache itself: tests/shared/textcache/; the prewarmer
as a process: tests/integration/test_prewarmer.py."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
import torch

from services.prewarmer.service import MODE_CHANGES, Prewarmer
from shared.infra.config import Settings
from shared.render.registry import TINY_WAN
from shared.render.text import TextEncoder
from shared.textcache.monitor import HitCounter, mode_key
from shared.textcache.remote import EmbeddingsUnavailable
from tests.shared.textcache.helpers import raw, remote, stored, tier_redis, tiny_encoder


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return tiny_encoder()


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


def test_remote_encoding_returns_what_the_local_encoder_gives_and_fills_l2_l3(
    settings, clean_state, encoder, prewarmer_thread
):
    texts = ["a horse in a field", "a horse in a field", ""]
    rows = remote(settings, 10).encode(encoder.identity, texts)
    for text, got in zip(texts, rows, strict=True):
        # The prewarmer encodes a batch packed (sorted by length, padded to the batch's longest text): the same rows
        # as one text at a time, up to float32 rounding for another batch shape.
        alone = encoder.encode([text])[0]
        assert got.shape == alone.shape and torch.allclose(got, alone, atol=1e-5)
        assert raw(settings, "l2", encoder.identity.key(text)) is not None


def test_remote_encoding_without_a_prewarmer_or_for_an_unloaded_model_is_unavailable(
    settings, clean_state, encoder, prewarmer_thread
):
    foreign = replace(encoder.identity, fingerprint="another-encoder")
    with pytest.raises(EmbeddingsUnavailable, match="not loaded here"):
        remote(settings, 10).encode(foreign, ["a tree"])


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
    from shared.textcache.upcoming import QueuedPrompts

    jobs = [QueuedPrompts(uuid.uuid4(), TINY_WAN, (f"a {c} balloon in the sky", "blurry")) for c in ("red", "blue")]
    prewarmer = Prewarmer(settings, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: jobs)
    report = prewarmer.cycle()
    assert report.encoded == 3 and report.promoted == 0  # "blurry" once
    for text in ("a red balloon in the sky", "a blue balloon in the sky", "blurry"):
        key = encoder.identity.key(text)
        prewarmed, alone = stored(settings, "l2", key, encoder), encoder.encode([text])[0]
        assert prewarmed.shape == alone.shape and torch.allclose(prewarmed, alone, atol=1e-5)  # packed: see above
        assert raw(settings, "l3", key) is not None

    # Gone from L2 (expired, evicted), still in L3: the next prewarmer copies it back without encoding.
    tier_redis(settings, "l2").delete(f"{settings.broker_key_prefix}vidq:emb:l2:{encoder.identity.key('blurry')}")
    again = Prewarmer(settings, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: jobs).cycle()
    assert (again.encoded, again.promoted) == (0, 1)
    assert raw(settings, "l2", encoder.identity.key("blurry")) is not None

    # No shared tier at all: nothing to fill, nothing encoded.
    off = settings.model_copy(update={"cache_l2_url": "off", "cache_l3_url": "off"})
    assert Prewarmer(off, encoders={(TINY_WAN, "float32"): encoder}, queued=lambda n: jobs).cycle().encoded == 0
