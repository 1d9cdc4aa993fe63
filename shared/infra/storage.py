"""S3 (MinIO/SeaweedFS/AWS) through the ``minio`` client, with timeouts on every call.

Reads (``exists``, ``open``, ``list_keys``, ``ensure_bucket``) are idempotent: one that meets an S3 outage
(``s3_unreachable``) is retried with the idempotent policy of shared/infra/retries.py (at most 3 retries, backoff
from 100 ms to 1 s). ``upload`` is tried once: the worker waits out an outage around it (services/worker/runner.py
``_upload``, through its S3 circuit breaker). ``ping`` is a probe and is never retried. The HTTP client itself
retries nothing, so a call is retried in exactly one place."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import urllib3
from minio import Minio
from minio.error import InvalidResponseError, S3Error, ServerError
from tenacity import retry_if_exception
from urllib3 import BaseHTTPResponse
from urllib3.exceptions import HTTPError as Urllib3Error

from shared.infra.config import Settings
from shared.infra.retries import idempotent

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PresignedUrl:
    url: str
    expires_at: datetime  # the URL's own deadline: its signing time plus X-Amz-Expires


# SigV4 refuses a presigned URL valid for longer than a week.
_MAX_PRESIGN_S = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str
    size: int
    sha256: str


def s3_client(
    endpoint: str,
    *,
    access_key: str,
    secret_key: str,
    secure: bool = False,
    region: str | None = None,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    retries: int = 0,
) -> Minio:
    """A minio client whose every request gives up after ``timeout_s`` (``connect_timeout_s`` to connect, when
    given): minio's own pool waits forever and retries for minutes. ``retries`` > 0 retries failed connections
    and 5xx answers with a short backoff; 0 fails at once, for a probe of an endpoint that may be down."""
    connect_s = timeout_s if connect_timeout_s is None else connect_timeout_s
    # False rather than Retry(0): a refused connection then surfaces as itself, not wrapped in MaxRetryError.
    retry: urllib3.Retry | bool = False
    if retries:
        retry = urllib3.Retry(total=retries, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504])
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=connect_s, read=timeout_s), retries=retry, maxsize=10)
    return Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region, http_client=http)


def make_client(settings: Settings, *, public: bool = False) -> Minio:
    endpoint, secure = settings.s3_endpoint, settings.s3_secure
    if public and settings.s3_public_endpoint:
        endpoint = settings.s3_public_endpoint
        secure = settings.s3_secure if settings.s3_public_secure is None else settings.s3_public_secure
    return s3_client(
        endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        secure=secure,
        region=settings.s3_region,
        timeout_s=settings.s3_timeout_s,
        connect_timeout_s=5.0,
        retries=0,  # Storage retries what may be retried (tenacity, shared/infra/retries.py)
    )


def s3_unreachable(exc: BaseException) -> bool:
    """S3 down, throttling or failing on its side (worth waiting for), not a refused request (bad credentials…).
    A 5xx without an S3 error document (a proxy or load balancer in front of S3 answering for it, a gateway
    timeout) is minio's ServerError or InvalidResponseError: as much an outage as a connection refused."""
    if isinstance(exc, S3Error):
        status = getattr(exc.response, "status", 0) or 0
        return status >= 500 or exc.code in {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"}
    if isinstance(exc, ServerError):
        return exc.status_code >= 500
    if isinstance(exc, InvalidResponseError):
        return (getattr(exc, "_code", 0) or 0) >= 500
    return isinstance(exc, Urllib3Error | ConnectionError | TimeoutError)


# What S3 answers for an object that is not there.
_MISSING = frozenset({"NoSuchKey", "NoSuchObject", "NotFound", "NoSuchBucket"})
# What S3 answers when the bucket exists already: AWS says which, other servers may say either.
_BUCKET_EXISTS = frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"})


def ensure_bucket(client: Minio, bucket: str) -> None:
    """Create ``bucket`` unless it exists."""
    if client.bucket_exists(bucket):
        return
    try:
        client.make_bucket(bucket)
    except S3Error as exc:
        # Another process (a second worker, the API) may create it between our check and our create.
        if exc.code not in _BUCKET_EXISTS:
            raise


def video_key(tenant_id: str, job_id: str) -> str:
    """Deterministic object key: a retried attempt overwrites the same object, never adds a second one."""
    return f"videos/{tenant_id}/{job_id}.mp4"


def poster_key(tenant_id: str, job_id: str) -> str:
    return f"videos/{tenant_id}/{job_id}.jpg"


class Storage:
    def __init__(
        self,
        settings: Settings,
        client: Minio | None = None,
        *,
        presign_bucket_s: int = 300,
        presign_cache_size: int = 4096,
    ) -> None:
        self.settings = settings
        self.client = client or make_client(settings)
        # Presigning is a local computation (the region is given), so the public client never connects anywhere.
        self.public_client = make_client(settings, public=True) if settings.s3_public_endpoint else self.client
        self.bucket = settings.s3_bucket
        self.presign_bucket_s = presign_bucket_s
        self.presign_cache_size = presign_cache_size
        self._presigned: OrderedDict[tuple[str, int, int], PresignedUrl] = OrderedDict()
        self._presign_lock = threading.Lock()  # the API presents jobs from several threads
        self._reads = idempotent(settings)

    def _read(self, call: Callable[[], T]) -> T:
        """An idempotent call, retried while S3 is unreachable (the idempotent policy)."""
        return self._reads.retrying(retry=retry_if_exception(s3_unreachable))(call)

    def ensure_bucket(self) -> None:
        self._read(lambda: ensure_bucket(self.client, self.bucket))

    def ping(self) -> bool:
        return self.client.bucket_exists(self.bucket)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (a HEAD). False for a missing object; S3 errors of any other kind raise."""
        try:
            self._read(lambda: self.client.stat_object(self.bucket, key))
        except S3Error as exc:
            if exc.code in _MISSING:
                return False
            raise
        return True

    def open(self, key: str) -> BaseHTTPResponse | None:
        """The stored object's body, not read yet (stream it, then ``close()`` and ``release_conn()``), or None when
        it is not stored. Each read of the stream has the client's timeout; S3 errors of any other kind raise."""
        try:
            return self._read(lambda: self.client.get_object(self.bucket, key))
        except S3Error as exc:
            if exc.code in _MISSING:
                return None
            raise

    def upload(self, key: str, path: Path, *, content_type: str) -> StoredObject:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        self.client.fput_object(
            self.bucket, key, str(path), content_type=content_type, metadata={"x-amz-meta-sha256": digest}
        )
        return StoredObject(key=key, size=path.stat().st_size, sha256=digest)

    def presign(self, key: str, *, expiry_s: int, now: datetime | None = None) -> PresignedUrl:
        """A GET URL valid for at least ``expiry_s``. Signing costs tens of microseconds (an HMAC chain), which a
        page of 100 jobs pays 200 times: so the URL is signed as of the start of a ``presign_bucket_s`` time bucket,
        valid for ``expiry_s`` plus the bucket's length, and kept in a bounded LRU, so every read within the bucket
        gets the same URL for a dict lookup (and a client or CDN caching by URL sees a stable one)."""
        now = now or datetime.now(UTC)
        bucket_s = min(self.presign_bucket_s, _MAX_PRESIGN_S - expiry_s)  # the extension must stay within a week
        if bucket_s < 1:
            return self._sign(key, signed_at=now.replace(microsecond=0), expires_s=expiry_s)
        start = int(now.timestamp()) // bucket_s * bucket_s
        memo_key = (key, start, expiry_s)
        with self._presign_lock:
            hit = self._presigned.get(memo_key)
            if hit is not None:
                self._presigned.move_to_end(memo_key)
                return hit
        signed = self._sign(key, signed_at=datetime.fromtimestamp(start, UTC), expires_s=expiry_s + bucket_s)
        with self._presign_lock:
            self._presigned[memo_key] = signed
            while len(self._presigned) > self.presign_cache_size:
                self._presigned.popitem(last=False)
        return signed

    def _sign(self, key: str, *, signed_at: datetime, expires_s: int) -> PresignedUrl:
        url = self.public_client.presigned_get_object(
            self.bucket, key, expires=timedelta(seconds=expires_s), request_date=signed_at
        )
        return PresignedUrl(url=url, expires_at=signed_at + timedelta(seconds=expires_s))

    def list_keys(self, prefix: str) -> list[str]:
        return self._read(
            lambda: [o.object_name for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)]
        )
