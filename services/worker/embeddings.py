"""Where a worker's prompt embeddings come from: the embedding cache (shared/textcache), and on a miss in every tier
the pipeline's own text encoder (``VIDQ_WORKER_TEXT_ENCODER=local``) or the prewarmer (``remote``).

One cache per pool process (``celery.resource``): its L1 lives as long as the process. Its forward prewarm reads
the next queued jobs from the broker's video queues and their texts from Postgres.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache, partial

import torch

from shared.infra.config import Settings
from shared.messaging.celery_app import VidqCelery
from shared.queues import video_queues
from shared.render.pipeline import TextRows, VideoPipeline
from shared.render.precision import resolve_device
from shared.render.text import EncoderIdentity, encoder_identity
from shared.textcache.factory import build_cache, control_client
from shared.textcache.hierarchy import EmbeddingCache
from shared.textcache.remote import RemoteEncoder
from shared.textcache.upcoming import peek_job_ids, queued_prompts


def text_rows(celery: VidqCelery, pipeline: VideoPipeline) -> TextRows:
    """The ``text_rows`` a render of ``pipeline`` uses in this process."""
    settings = celery.settings
    encode = (
        pipeline.encode_texts
        if pipeline.encoder is not None
        else partial(remote_encoder(celery).encode, pipeline.identity)
    )
    if not settings.cache_enabled:
        return encode
    cache = embedding_cache(celery)
    return lambda texts: cache.get(pipeline.identity, texts, encode)


def embedding_cache(celery: VidqCelery) -> EmbeddingCache:
    settings = celery.settings
    return celery.resource("embeddings", lambda: build_cache(settings, neighbours=partial(_neighbours, celery)))


def remote_encoder(celery: VidqCelery) -> RemoteEncoder:
    settings = celery.settings
    timeout = settings.worker_remote_encode_timeout_s
    return celery.resource(
        "remote_encoder",
        lambda: RemoteEncoder(
            control_client(settings, blocking_s=timeout), prefix=settings.broker_key_prefix, timeout_s=timeout
        ),
    )


def _neighbours(celery: VidqCelery, count: int) -> Sequence[tuple[EncoderIdentity, str]]:
    """The texts of the next ``count`` jobs this worker's pool's video queues will hand out, in the order its workers
    take them."""
    settings = celery.settings
    client = celery.resource("cache_control", lambda: control_client(settings))
    ids = peek_job_ids(
        client, prefix=settings.broker_key_prefix, queues=video_queues(settings.worker_pool), limit=count, order="next"
    )
    return [(_identity(settings, job.model), text) for job in queued_prompts(settings, ids) for text in job.texts]


def _identity(settings: Settings, model: str) -> EncoderIdentity:
    _, dtype = resolve_device(settings.device, cuda_dtype=settings.cuda_dtype)
    return _identity_cached(model, dtype, settings.model_dir)


@lru_cache(maxsize=64)
def _identity_cached(model: str, dtype: torch.dtype, model_dir: str | None) -> EncoderIdentity:
    return encoder_identity(model, dtype=dtype, model_dir=model_dir)
