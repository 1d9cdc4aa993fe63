"""Every API error carries its own HTTP status and stable code (the error envelope's `code`)."""

from __future__ import annotations

import pytest

from services.api.error_handlers import error_body
from shared import errors


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [(errors.JobCancelled, 409, "cancelled"), (errors.LeaseLost, 409, "lease_lost")],
)
def test_worker_errors_keep_their_status_and_code(error: type[errors.VidqError], status: int, code: str) -> None:
    assert (error.status_code, error.code) == (status, code)
    # As the API renders it (services/api/error_handlers.py): the error's own status and code in the envelope.
    rendered = error_body("/v1/jobs/x", error.status_code, error.code, error("x").message)
    assert rendered == (status, {"error": {"code": code, "message": "x", "details": None}})


def test_every_vidq_error_subclass_names_a_code_of_its_own() -> None:
    subclasses = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.VidqError)]
    codes = [c.code for c in subclasses if c is not errors.VidqError]
    assert len(codes) == len(set(codes)) and "internal_error" not in codes


def test_embeddings_unavailable_is_a_retryable_worker_error_not_an_api_one() -> None:
    assert not issubclass(errors.EmbeddingsUnavailable, errors.VidqError)
