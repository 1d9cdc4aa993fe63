"""S3 (MinIO/SeaweedFS/AWS) through the ``minio`` client, with timeouts on every call."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import urllib3
from minio import Minio

from shared.config import Settings


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str
    size: int
    sha256: str


def make_client(settings: Settings, *, public: bool = False) -> Minio:
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=5.0, read=settings.s3_timeout_s),
        retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        maxsize=10,
    )
    endpoint, secure = settings.s3_endpoint, settings.s3_secure
    if public and settings.s3_public_endpoint:
        endpoint = settings.s3_public_endpoint
        secure = settings.s3_secure if settings.s3_public_secure is None else settings.s3_public_secure
    return Minio(
        endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        secure=secure,
        region=settings.s3_region,
        http_client=http,
    )


def video_key(tenant_id: str, job_id: str) -> str:
    """Deterministic object key: a retried attempt overwrites the same object, never adds a second one."""
    return f"videos/{tenant_id}/{job_id}.mp4"


def poster_key(tenant_id: str, job_id: str) -> str:
    return f"videos/{tenant_id}/{job_id}.jpg"


class Storage:
    def __init__(self, settings: Settings, client: Minio | None = None) -> None:
        self.settings = settings
        self.client = client or make_client(settings)
        # Presigning is a local computation (the region is given), so the public client never connects anywhere.
        self.public_client = make_client(settings, public=True) if settings.s3_public_endpoint else self.client
        self.bucket = settings.s3_bucket

    def ensure_bucket(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            self.client.make_bucket(self.bucket)

    def ping(self) -> bool:
        return self.client.bucket_exists(self.bucket)

    def upload(self, key: str, path: Path, *, content_type: str) -> StoredObject:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        self.client.fput_object(
            self.bucket, key, str(path), content_type=content_type, metadata={"x-amz-meta-sha256": digest}
        )
        return StoredObject(key=key, size=path.stat().st_size, sha256=digest)

    def presign(self, key: str, *, expiry_s: int) -> str:
        return self.public_client.presigned_get_object(self.bucket, key, expires=timedelta(seconds=expiry_s))

    def list_keys(self, prefix: str) -> list[str]:
        return [o.object_name for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)]
