"""Real connection attempts against Postgres, Redis and S3, each bounded by a timeout."""

from __future__ import annotations

import math
import re
from contextlib import suppress
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
import urllib3
from minio.error import MinioException
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from shared.infra.redis_clients import client as redis_client
from shared.infra.storage import s3_client

_DRIVER = re.compile(r"^(postgres(?:ql)?)\+\w+://")


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://…`` (SQLAlchemy's form) → ``postgresql://…`` (what libpq and psycopg parse)."""
    return _DRIVER.sub(r"\1://", url)


def redact_url(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _connect_timeout(timeout_s: float) -> int:
    # libpq takes whole seconds and treats anything under 2 as 2.
    return max(2, math.ceil(timeout_s))


def _maintenance_conninfo(url: str) -> str:
    # The maintenance database always exists; the one named in the URL may not yet.
    return make_conninfo(libpq_url(url), dbname="postgres")


def probe_postgres(url: str, timeout_s: float = 2) -> bool:
    """True when the server in ``url`` accepts the URL's user and runs a query (in the ``postgres``
    database, so a server whose vidq database is still to be created counts as up)."""
    try:
        with psycopg.connect(
            _maintenance_conninfo(url), connect_timeout=_connect_timeout(timeout_s), autocommit=True
        ) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def postgres_has_vector(url: str, timeout_s: float = 2) -> bool:
    """True when the server in ``url`` answers and offers the pgvector extension (``vector``), which vidq's
    schema creates for similar-video search."""
    try:
        with psycopg.connect(
            _maintenance_conninfo(url), connect_timeout=_connect_timeout(timeout_s), autocommit=True
        ) as conn:
            return conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone() is not None
    except psycopg.Error:
        return False


def probe_redis(url: str, timeout_s: float = 2) -> bool:
    """True when ``url`` answers PING (a server busy loading its dump counts as not yet up)."""
    # redis-py retries failed commands by default, which would multiply the timeout.
    client = redis_client(url, timeout_s=timeout_s, retries=0)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def probe_s3(endpoint: str, access_key: str, secret_key: str, secure: bool, timeout_s: float = 2) -> bool:
    """True when ``endpoint`` (``host:port``) answers a signed ListBuckets with these credentials."""
    client = s3_client(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, timeout_s=timeout_s)
    try:
        client.list_buckets()
        return True
    except (MinioException, urllib3.exceptions.HTTPError, OSError):
        return False


def ensure_database(url: str, *, timeout_s: float = 5) -> None:
    """Create the database named in ``url`` unless it exists (the server itself must be up)."""
    name = conninfo_to_dict(libpq_url(url)).get("dbname")
    if not name:
        raise ValueError(f"no database name in {redact_url(url)}")
    # CREATE DATABASE cannot run inside a transaction block, hence autocommit.
    with psycopg.connect(
        _maintenance_conninfo(url), connect_timeout=_connect_timeout(timeout_s), autocommit=True
    ) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return
        # Another process may create it between our check and our CREATE.
        with suppress(errors.DuplicateDatabase, errors.UniqueViolation):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(name))))
