"""Object keys and presigned URLs (presigning is local: no S3 server is needed for these)."""

from __future__ import annotations

from urllib.parse import urlparse

from shared.config import Settings
from shared.storage import Storage, poster_key, video_key


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
