"""This worker process's circuit breakers (shared/infra/breakers.py: in memory, one set per process): S3, and each
model and shape it renders. Made on first use, from the settings of the first job."""

from __future__ import annotations

import threading

from shared.infra.breakers import BreakerRule, BreakerSet, CircuitBreaker
from shared.infra.config import Settings
from shared.spec import GenerationSpec

_lock = threading.Lock()
_s3: list[CircuitBreaker] = []
_models: list[BreakerSet] = []


def s3_breaker(settings: Settings) -> CircuitBreaker:
    with _lock:
        if not _s3:
            _s3.append(CircuitBreaker("s3", BreakerRule.from_settings(settings)))
        return _s3[0]


def model_breaker(settings: Settings, spec: GenerationSpec) -> CircuitBreaker:
    """The breaker of the spec's model and shape (``model:HEIGHTxWIDTHxFRAMES``)."""
    with _lock:
        if not _models:
            _models.append(BreakerSet("model", BreakerRule.from_settings(settings), max_keys=settings.breaker_max_keys))
        breakers = _models[0]
    return breakers.get(f"{spec.model}:{spec.height}x{spec.width}x{spec.num_frames}")
