"""One error hierarchy: each error carries an HTTP status and a stable code; the API renders all of them as
``{"error": {"code", "message", "details"}}``. (Workers tell transient from permanent failures by exception type:
services/worker/runner.py.)"""

from __future__ import annotations

from typing import Any


class VidqError(Exception):
    status_code = 500
    code = "internal_error"
    retry_after_s: int | None = None  # set: the client should come back after this many seconds (Retry-After)

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(VidqError):
    """``fields``: the request field each problem is about (None for a combination of fields), in the order of the
    message, where the code that refused the request knows it (the operator's caps: ``JobCreate.to_spec``); an API
    that names its parameters differently reads them here, never from the message."""

    status_code = 422
    code = "invalid_request"

    def __init__(self, message: str, *, details: Any = None, fields: list[str | None] | None = None) -> None:
        super().__init__(message, details=details)
        self.fields = fields or []


class UnsupportedMediaType(VidqError):
    status_code = 415
    code = "unsupported_media_type"


class Unauthorized(VidqError):
    status_code = 401
    code = "unauthorized"


class NotFound(VidqError):
    status_code = 404
    code = "not_found"


class Conflict(VidqError):
    status_code = 409
    code = "conflict"


class QueueFull(VidqError):
    """The job's class holds as many waiting jobs as the admission watermark allows: nothing was written."""

    status_code = 429
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int, details: Any = None) -> None:
        super().__init__(message, details=details)
        self.retry_after_s = retry_after_s


class IdempotencyKeyReused(VidqError):
    status_code = 422
    code = "idempotency_key_reused"


class InvalidTransition(Conflict):
    code = "invalid_transition"


class JobCancelled(VidqError):
    """Raised inside a render when the job was cancelled; stops the denoising loop."""

    status_code = 409
    code = "cancelled"


class LeaseLost(VidqError):
    """The worker's fencing token is stale: another attempt owns the job now."""

    status_code = 409
    code = "lease_lost"


class EmbeddingsUnavailable(Exception):
    """No embedding for a text: no cache tier has it, and no prewarmer answered in time. Retryable.

    Defined here, not beside the remote encoder that raises it, so the worker's task module imports no torch: Celery's
    main process loads that module, and a process that touched CUDA cannot fork a pool process that uses it.
    """


class ModelUnavailable(Exception):
    """A job's model and shape keep failing on this worker (their circuit breaker is open, shared/infra/breakers.py):
    the job fails at once with ``model_unavailable`` instead of rendering, unless it allows a degraded render.
    Defined here, torch-free, for the same reason as ``EmbeddingsUnavailable``."""


class PoolNotAllowed(VidqError):
    """A request chose a worker pool (``X-Vidq-Pool``) for a tenant that may not: nothing was written."""

    status_code = 403
    code = "pool_not_allowed"
