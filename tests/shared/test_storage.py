"""Object keys, presigned URLs and the client's limits (none of these needs an S3 server: presigning is local)."""

from __future__ import annotations

import time
from typing import cast
from urllib.parse import urlparse

import pytest
import urllib3
from minio import Minio
from minio.error import S3Error

from shared.config import Settings
from shared.storage import Storage, ensure_bucket, poster_key, s3_client, video_key
from tools.processes import free_ports


def test_keys_are_deterministic_per_tenant_and_job():
    assert video_key("t1", "j1") == "videos/t1/j1.mp4" == video_key("t1", "j1")
    assert poster_key("t1", "j1") == "videos/t1/j1.jpg"


def test_presigned_urls_use_the_public_endpoint_when_set():
    internal = Storage(Settings(s3_endpoint="minio.vidq-data.svc:9000", s3_bucket="vidq"))
    url = urlparse(internal.presign("videos/t/j.mp4", expiry_s=600))
    assert (url.scheme, url.netloc) == ("http", "minio.vidq-data.svc:9000")
    public = Storage(
        Settings(
            s3_endpoint="minio.vidq-data.svc:9000",
            s3_bucket="vidq",
            s3_public_endpoint="media.example.com",
            s3_public_secure=True,
        )
    )
    url = urlparse(public.presign("videos/t/j.mp4", expiry_s=600))
    assert (url.scheme, url.netloc, url.path) == ("https", "media.example.com", "/vidq/videos/t/j.mp4")
    assert "X-Amz-Expires=600" in url.query


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


def test_a_client_without_retries_fails_fast_on_a_dead_endpoint() -> None:
    port = free_ports(1)[0]  # nothing listens there
    client = s3_client(f"127.0.0.1:{port}", access_key="k", secret_key="s", region="us-east-1", timeout_s=1)
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):
        client.list_buckets()
    assert time.monotonic() - started < 2
