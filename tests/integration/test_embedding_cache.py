"""The embedding cache with a real API process: an L2 hit forward-prewarms the next queued jobs' texts into L1.
The cache on its own: tests/shared/textcache/test_embedding_cache.py; the prewarmer in this process:
tests/services/prewarmer/test_embedding_cache.py."""

from __future__ import annotations

import pytest

from services.worker.embeddings import _neighbours
from shared.messaging.celery_app import make_celery
from shared.render.text import TextEncoder, texts_of
from shared.textcache.factory import build_cache
from tests.integration.helpers import submit
from tests.shared.textcache.helpers import CountingEncoder, counts, new_cache, tiny_encoder


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return tiny_encoder()


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
