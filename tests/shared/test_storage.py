"""Object keys, presigned URLs and the client's limits (none of these needs an S3 server: presigning is local)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import cast
from urllib.parse import parse_qs, urlparse

import pytest
import urllib3
from minio import Minio
from minio.error import S3Error

from shared.infra.config import Settings
from shared.infra.storage import Storage, ensure_bucket, poster_key, s3_client, video_key
from tests.shared.sockets import ClosingListener
from tools.processes import free_ports


def test_keys_are_deterministic_per_tenant_and_job():
    assert video_key("t1", "j1") == "videos/t1/j1.mp4" == video_key("t1", "j1")
    assert poster_key("t1", "j1") == "videos/t1/j1.jpg"


def test_presigned_urls_use_the_public_endpoint_when_set():
    internal = Storage(Settings(s3_endpoint="minio.vidq-data.svc:9000", s3_bucket="vidq"))
    url = urlparse(internal.presign("videos/t/j.mp4", expiry_s=600).url)
    assert (url.scheme, url.netloc) == ("http", "minio.vidq-data.svc:9000")
    public = Storage(
        Settings(
            s3_endpoint="minio.vidq-data.svc:9000",
            s3_bucket="vidq",
            s3_public_endpoint="media.example.com",
            s3_public_secure=True,
        )
    )
    url = urlparse(public.presign("videos/t/j.mp4", expiry_s=600).url)
    assert (url.scheme, url.netloc, url.path) == ("https", "media.example.com", "/vidq/videos/t/j.mp4")
    assert "X-Amz-Expires=900" in url.query  # 600 s from the start of its 300 s time bucket at the least


def test_presigned_urls_are_signed_per_time_bucket_and_remembered():
    storage = Storage(Settings(s3_endpoint="minio:9000", s3_bucket="vidq"), presign_bucket_s=300, presign_cache_size=2)
    start = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)  # a bucket boundary
    first = storage.presign("a.mp4", expiry_s=600, now=start + timedelta(seconds=1))
    late = storage.presign("a.mp4", expiry_s=600, now=start + timedelta(seconds=299))
    assert late is first  # the same bucket: one signature, then a lookup
    query = parse_qs(urlparse(first.url).query)
    assert query["X-Amz-Date"] == ["20261201T100000Z"] and query["X-Amz-Expires"] == ["900"]
    # The reported deadline is the URL's own, and at least expiry_s after every read that got it.
    assert first.expires_at == start + timedelta(seconds=900) >= start + timedelta(seconds=299 + 600)
    following = storage.presign("a.mp4", expiry_s=600, now=start + timedelta(seconds=300))
    assert following.url != first.url and following.expires_at == start + timedelta(seconds=1200)
    # Bounded: the least recently used entry goes first.
    storage.presign("b.mp4", expiry_s=600, now=start + timedelta(seconds=300))
    storage.presign("c.mp4", expiry_s=600, now=start + timedelta(seconds=300))
    assert len(storage._presigned) == 2
    assert storage.presign("a.mp4", expiry_s=600, now=start + timedelta(seconds=301)) is not following


def test_a_week_long_expiry_is_not_extended_past_what_sigv4_allows():
    storage = Storage(Settings(s3_endpoint="minio:9000", s3_bucket="vidq"))
    week = 7 * 24 * 3600
    url = storage.presign("a.mp4", expiry_s=week - 100).url
    assert parse_qs(urlparse(url).query)["X-Amz-Expires"] == [str(week)]
    assert "X-Amz-Expires" in storage.presign("a.mp4", expiry_s=week).url


class _LateClient:
    """A bucket that is missing when asked about, then created by someone else before our create lands."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.creates = 0

    def bucket_exists(self, bucket: str) -> bool:
        return False

    def make_bucket(self, bucket: str) -> None:
        self.creates += 1
        raise S3Error(urllib3.HTTPResponse(status=409), self.code, "taken", f"/{bucket}", "req", "host", bucket)


@pytest.mark.parametrize("code", ["BucketAlreadyOwnedByYou", "BucketAlreadyExists"])
def test_ensure_bucket_counts_a_bucket_created_meanwhile_as_success(code: str) -> None:
    client = _LateClient(code)
    ensure_bucket(cast(Minio, client), "vidq")
    assert client.creates == 1


def test_ensure_bucket_raises_other_errors() -> None:
    with pytest.raises(S3Error, match="AccessDenied"):
        ensure_bucket(cast(Minio, _LateClient("AccessDenied")), "vidq")


def _client(address: str, *, retries: int = 0) -> Minio:
    return s3_client(address, access_key="k", secret_key="s", region="us-east-1", timeout_s=1, retries=retries)


def test_a_client_without_retries_fails_fast_on_a_dead_endpoint() -> None:
    """Fast because it tries once, shown by counting connections, not by timing: a dead endpoint raises, and an
    endpoint that drops every connection sees exactly one."""
    with pytest.raises(urllib3.exceptions.HTTPError):
        _client(f"127.0.0.1:{free_ports(1)[0]}").list_buckets()  # nothing listens there

    with ClosingListener() as dropping:
        with pytest.raises(urllib3.exceptions.HTTPError):
            _client(dropping.address).list_buckets()
        assert dropping.accepted == 1
        # The listener counts retries when there are some: one retry, two connections.
        with pytest.raises(urllib3.exceptions.HTTPError):
            _client(dropping.address, retries=1).list_buckets()
        assert dropping.accepted == 1 + 2
