"""Which upload errors are an S3 outage (waited out, no attempt spent) and which are a refused request (fail)."""

from __future__ import annotations

import pytest
from minio.error import InvalidResponseError, S3Error, ServerError
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError

from shared.infra.storage import s3_unreachable


class _Response:
    def __init__(self, status: int) -> None:
        self.status = status


def _s3_error(status: int, code: str) -> S3Error:
    return S3Error(_Response(status), code, "message", "/bucket/key", "req", "host")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "exc",
    [
        MaxRetryError(None, "/bucket/key", NewConnectionError(None, "Connection refused")),  # type: ignore[arg-type]
        ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")),
        ConnectionRefusedError(111, "refused"),
        TimeoutError("timed out"),
        _s3_error(503, "SlowDown"),
        _s3_error(500, "InternalError"),
        _s3_error(400, "RequestTimeout"),
        ServerError("server failed with HTTP status code 502", 502),
        InvalidResponseError(504, "text/html", "<html>gateway timeout</html>"),
    ],
)
def test_outages_are_waited_out(exc: BaseException) -> None:
    assert s3_unreachable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        _s3_error(403, "AccessDenied"),
        _s3_error(404, "NoSuchBucket"),
        _s3_error(400, "InvalidArgument"),
        InvalidResponseError(403, "text/html", "forbidden"),
        ServerError("server failed with HTTP status code 304", 304),
        ValueError("not an outage"),
    ],
)
def test_refused_requests_are_not(exc: BaseException) -> None:
    assert not s3_unreachable(exc)
