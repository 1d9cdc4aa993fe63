"""tools.devstack against real processes: SeaweedFS, redis-server and PostgreSQL from their wheels, and this
machine's own Postgres and Redis where they answer."""

from __future__ import annotations

import io
import logging
import re
import socket
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import kombu
import psutil
import psycopg
import pytest
import redis
from minio import Minio
from psycopg import errors, sql

from shared.infra.storage import s3_client
from tools.devstack import (
    DevStack,
    EmbeddedPostgres,
    EmbeddedRedis,
    SeaweedS3,
    ensure_database,
    libpq_url,
    postgres_has_vector,
    postgres_with_vector,
    probe_postgres,
    probe_redis,
    probe_s3,
)
from tools.processes import free_ports

pytestmark = pytest.mark.integration

ACCESS_KEY = "devstack-test"
SECRET_KEY = "devstack-test-secret"
BUCKET = "devstack-test"
# The services a development machine runs itself; the tests that reuse them skip where they do not answer.
LOCAL_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS = "redis://127.0.0.1:6379/15"


def _client(endpoint: str) -> Minio:
    # A region spares the client a GetBucketLocation round trip before presigning.
    return s3_client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, timeout_s=10, region="us-east-1")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def _url_listening(url: str) -> bool:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    assert parts.hostname is not None and parts.port is not None
    return _listening(parts.hostname, parts.port)


def _redis_pid(log_path: Path) -> int:
    """The pid an embedded redis-server reports in its own log ("… pid=1234, just started")."""
    found = re.search(r"\bpid=(\d+)", log_path.read_text())
    assert found is not None, f"no pid in {log_path}"
    return int(found.group(1))


def _still_running(pid: int, name: str) -> bool:
    """Whether ``pid`` is still a live ``name`` (a reused pid running something else does not count)."""
    try:
        process = psutil.Process(pid)
        return process.name() == name and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _database_exists(name: str, server: str = LOCAL_POSTGRES) -> bool:
    with psycopg.connect(libpq_url(server), connect_timeout=5) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def _drop_database(name: str, server: str = LOCAL_POSTGRES) -> None:
    with psycopg.connect(libpq_url(server), connect_timeout=5, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _can_create_vector(url: str) -> bool:
    """Whether ``CREATE EXTENSION vector`` succeeds in the database of ``url`` (rolled back: nothing stays)."""
    with psycopg.connect(libpq_url(url), connect_timeout=5) as conn:
        try:
            with conn.transaction(force_rollback=True):
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        # A missing control file: FeatureNotSupported ("extension … is not available") on current servers,
        # UndefinedFile ("could not open extension control file") on older ones.
        except (errors.FeatureNotSupported, errors.UndefinedFile):
            return False
    return True


@pytest.fixture(scope="module")
def vector_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The maintenance URL of a server that offers pgvector: the machine's where it does, else an embedded one
    standing in for it (as a configured server, not one DevStack starts)."""
    if postgres_has_vector(LOCAL_POSTGRES):
        yield LOCAL_POSTGRES
        return
    with EmbeddedPostgres(tmp_path_factory.mktemp("vector-postgres"), database="postgres") as server:
        yield server.url


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    data_dir = tmp_path_factory.mktemp("seaweed")
    with SeaweedS3(data_dir, access_key=ACCESS_KEY, secret_key=SECRET_KEY, bucket=BUCKET) as s3:
        yield s3


@pytest.fixture
def local_postgres() -> None:
    if not probe_postgres(LOCAL_POSTGRES):
        pytest.skip("this machine runs no Postgres at 127.0.0.1:5432")


@pytest.fixture
def local_redis() -> None:
    if not probe_redis(LOCAL_REDIS):
        pytest.skip("this machine runs no Redis at 127.0.0.1:6379")


def test_probes_say_no_when_nothing_listens() -> None:
    port = free_ports(1)[0]
    assert not probe_postgres(f"postgresql+psycopg://postgres@127.0.0.1:{port}/vidq")
    assert not postgres_has_vector(f"postgresql+psycopg://postgres@127.0.0.1:{port}/vidq")
    assert not probe_redis(f"redis://127.0.0.1:{port}/0")
    assert not probe_s3(f"127.0.0.1:{port}", ACCESS_KEY, SECRET_KEY, False)


def test_probes_say_no_when_a_server_never_answers() -> None:
    """A listener that never accepts: the kernel completes every handshake, and no byte ever comes back. Each
    probe gives up on its own timeout (a probe without one would hang until pytest-timeout ends the test)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        port = silent.getsockname()[1]
        assert not probe_postgres(f"postgresql+psycopg://postgres@127.0.0.1:{port}/vidq", timeout_s=0.5)
        assert not postgres_has_vector(f"postgresql+psycopg://postgres@127.0.0.1:{port}/vidq", timeout_s=0.5)
        assert not probe_redis(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
        assert not probe_s3(f"127.0.0.1:{port}", ACCESS_KEY, SECRET_KEY, False, timeout_s=0.5)


def test_seaweed_creates_the_bucket_and_leaves_it_empty(seaweed: SeaweedS3) -> None:
    client = _client(seaweed.endpoint)
    assert client.bucket_exists(BUCKET)
    assert list(client.list_objects(BUCKET, recursive=True)) == []


def test_seaweed_refuses_a_wrong_secret(seaweed: SeaweedS3) -> None:
    assert probe_s3(seaweed.endpoint, ACCESS_KEY, SECRET_KEY, False)
    assert not probe_s3(seaweed.endpoint, ACCESS_KEY, "not-the-secret", False)


def test_seaweed_round_trips_an_object(seaweed: SeaweedS3) -> None:
    # Past weed's 4 MiB chunk size, so the object is stored in several chunks.
    payload = bytes(range(256)) * (5 * 4096 + 7)
    client = _client(seaweed.endpoint)
    client.put_object(BUCKET, "videos/round-trip.bin", io.BytesIO(payload), len(payload))
    response = client.get_object(BUCKET, "videos/round-trip.bin")
    try:
        assert response.read() == payload
    finally:
        response.close()
        response.release_conn()


def test_seaweed_serves_a_presigned_get(seaweed: SeaweedS3) -> None:
    payload = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 100
    client = _client(seaweed.endpoint)
    client.put_object(BUCKET, "videos/presigned.mp4", io.BytesIO(payload), len(payload), content_type="video/mp4")
    url = client.presigned_get_object(BUCKET, "videos/presigned.mp4", expires=timedelta(minutes=5))
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    assert response.content == payload
    # The signature is checked: the same URL without it is refused.
    assert httpx.get(url.split("?", 1)[0], timeout=10).status_code == 403


def test_seaweed_stop_frees_its_port(tmp_path: Path) -> None:
    with SeaweedS3(tmp_path, access_key=ACCESS_KEY, secret_key=SECRET_KEY, bucket=BUCKET) as s3:
        port = s3.port
        assert port is not None and _listening("127.0.0.1", port)
    assert not _listening("127.0.0.1", port)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    assert not Path(f"/tmp/seaweedfs-s3-{port}.sock").exists()


def test_embedded_redis_serves_redis_py_and_kombu_and_keeps_its_data(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis") as embedded:
        url = embedded.url
        client = redis.Redis.from_url(url, socket_timeout=5)
        assert client.set("devstack", "value")
        assert client.get("devstack") == b"value"
        client.close()
        # Celery's transport takes the same URL.
        with kombu.Connection(url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
    assert not probe_redis(url, timeout_s=1)
    # SIGTERM made redis write its dump; a restart on another port finds the key again.
    with EmbeddedRedis(tmp_path / "redis") as embedded:
        again = redis.Redis.from_url(embedded.url, socket_timeout=5)
        assert again.get("devstack") == b"value"
        again.close()


def test_embedded_postgres_answers_select_1_in_its_database(tmp_path: Path) -> None:
    # The slowest embedded start (initdb on first use): about 1-2 s here.
    with EmbeddedPostgres(tmp_path / "postgres", database="vidq_embedded") as embedded:
        url = embedded.url
        assert url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
        with psycopg.connect(libpq_url(url), connect_timeout=5) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert conn.info.dbname == "vidq_embedded"
    assert not _url_listening(url)


@pytest.mark.usefixtures("local_postgres")
def test_ensure_database_creates_a_missing_database() -> None:
    name = f"vidq_devstack_{uuid.uuid4().hex[:8]}"
    url = LOCAL_POSTGRES.rsplit("/", 1)[0] + f"/{name}"
    try:
        assert not _database_exists(name)
        ensure_database(url)
        assert _database_exists(name)
        ensure_database(url)  # a second call finds it and does nothing
    finally:
        _drop_database(name)


@pytest.mark.usefixtures("local_redis")
def test_devstack_reuses_a_postgres_with_pgvector_and_the_machines_redis_and_starts_only_s3(
    tmp_path: Path, vector_postgres: str
) -> None:
    name = f"vidq_devstack_{uuid.uuid4().hex[:8]}"
    database_url = vector_postgres.rsplit("/", 1)[0] + f"/{name}"
    stack = DevStack()
    try:
        urls = stack.start(
            tmp_path,
            database_url=database_url,
            broker_url=LOCAL_REDIS,
            s3_endpoint=None,
            s3_access_key=ACCESS_KEY,
            s3_secret_key=SECRET_KEY,
            bucket=BUCKET,
        )
        assert stack.embedded == ["s3"]
        assert (urls.database_url, urls.broker_url) == (database_url, LOCAL_REDIS)
        assert _database_exists(name, vector_postgres)
        assert not (tmp_path / "postgres").exists() and not (tmp_path / "redis").exists()
        assert _client(urls.s3_endpoint).bucket_exists(BUCKET)
        assert stack.env() == {
            "VIDQ_DATABASE_URL": database_url,
            "VIDQ_BROKER_URL": LOCAL_REDIS,
            "VIDQ_S3_ENDPOINT": urls.s3_endpoint,
            "VIDQ_S3_ACCESS_KEY": ACCESS_KEY,
            "VIDQ_S3_SECRET_KEY": SECRET_KEY,
            "VIDQ_S3_SECURE": "false",
            "VIDQ_S3_BUCKET": BUCKET,
        }
        assert SECRET_KEY not in repr(urls)
    finally:
        stack.stop()
        _drop_database(name, vector_postgres)
    # Only what it started is gone.
    assert not _url_listening(urls.s3_endpoint)
    assert probe_postgres(vector_postgres) and probe_redis(LOCAL_REDIS)


@pytest.mark.usefixtures("local_postgres")
def test_devstack_embeds_postgres_where_the_configured_one_lacks_pgvector(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if postgres_has_vector(LOCAL_POSTGRES):
        pytest.skip("this machine's Postgres at 127.0.0.1:5432 offers pgvector")
    caplog.set_level(logging.INFO, logger="tools.devstack.stack")
    name = f"vidq_devstack_{uuid.uuid4().hex[:8]}"
    with DevStack() as stack:
        urls = stack.start(
            tmp_path,
            database_url=LOCAL_POSTGRES.rsplit("/", 1)[0] + f"/{name}",
            broker_url=None,
            s3_endpoint=None,
            s3_access_key=ACCESS_KEY,
            s3_secret_key=SECRET_KEY,
            bucket=BUCKET,
        )
        assert stack.embedded == ["postgres", "redis", "s3"]
        assert urls.database_url.endswith(f"/{name}") and ":5432/" not in urls.database_url
        with psycopg.connect(libpq_url(urls.database_url), connect_timeout=5, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            assert conn.execute("SELECT '[1,2]'::vector <=> '[2,4]'::vector").fetchone() == (0.0,)
    assert "127.0.0.1:5432/" in caplog.text and "has no pgvector extension" in caplog.text
    # The machine's server is left alone, and nothing was created on it.
    assert probe_postgres(LOCAL_POSTGRES) and not _database_exists(name)


def test_devstack_reuses_a_configured_postgres_that_offers_pgvector(tmp_path: Path) -> None:
    """A server this test starts itself stands in for a configured one with pgvector: DevStack uses it, creates its
    database there, and leaves it running at stop."""
    with EmbeddedPostgres(tmp_path / "configured", database="postgres") as server:
        database_url = server.url.rsplit("/", 1)[0] + "/vidq_configured"
        with DevStack() as stack:
            urls = stack.start(
                tmp_path / "stack",
                database_url=database_url,
                broker_url=None,
                s3_endpoint=None,
                s3_access_key=ACCESS_KEY,
                s3_secret_key=SECRET_KEY,
                bucket=BUCKET,
            )
            assert "postgres" not in stack.embedded
            assert urls.database_url == database_url
            assert _database_exists("vidq_configured", server.url)
            assert _can_create_vector(database_url)
        assert not (tmp_path / "stack" / "postgres").exists()
        assert probe_postgres(server.url)


def test_postgres_has_vector_says_which_servers_offer_it(vector_postgres: str) -> None:
    assert postgres_has_vector(vector_postgres) and _can_create_vector(vector_postgres)
    assert not postgres_has_vector(f"postgresql+psycopg://postgres@127.0.0.1:{free_ports(1)[0]}/vidq")


@pytest.mark.usefixtures("local_postgres")
def test_postgres_has_vector_agrees_with_create_extension_on_the_machines_postgres() -> None:
    """The probe against the server's own answer to CREATE EXTENSION. Where the machine's Postgres lacks pgvector,
    this is the case of a server that answers and still gets False."""
    assert postgres_has_vector(LOCAL_POSTGRES) == _can_create_vector(LOCAL_POSTGRES)


def test_postgres_with_vector_reuses_a_server_that_offers_it(vector_postgres: str) -> None:
    name = f"vidq_devstack_{uuid.uuid4().hex[:8]}"
    url = vector_postgres.rsplit("/", 1)[0] + f"/{name}"
    try:
        with postgres_with_vector(url) as yielded:
            assert yielded == url and _database_exists(name, vector_postgres)
        assert probe_postgres(vector_postgres)
    finally:
        _drop_database(name, vector_postgres)


def test_postgres_with_vector_embeds_one_in_a_temporary_directory_where_none_answers() -> None:
    dead = free_ports(1)[0]
    with postgres_with_vector(f"postgresql+psycopg://postgres@127.0.0.1:{dead}/vidq_fallback") as url:
        assert url.endswith("/vidq_fallback") and f":{dead}/" not in url
        assert _can_create_vector(url)
        with psycopg.connect(libpq_url(url), connect_timeout=5) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        assert row is not None
        data_dir = Path(row[0])
        assert data_dir.is_dir()
    assert not _url_listening(url)
    assert not data_dir.parent.exists()  # the temporary directory is gone


def test_devstack_embeds_every_service_that_does_not_answer(tmp_path: Path) -> None:
    dead = free_ports(1)[0]  # nothing listens there
    with DevStack() as stack:
        urls = stack.start(
            tmp_path,
            database_url=f"postgresql+psycopg://postgres@127.0.0.1:{dead}/vidq_fallback",
            broker_url=f"redis://127.0.0.1:{dead}/3",
            s3_endpoint=f"127.0.0.1:{dead}",
            s3_access_key=ACCESS_KEY,
            s3_secret_key=SECRET_KEY,
            bucket=BUCKET,
        )
        assert stack.embedded == ["postgres", "redis", "s3"]
        assert urls.database_url.endswith("/vidq_fallback") and urls.broker_url.endswith("/3")
        with psycopg.connect(libpq_url(urls.database_url), connect_timeout=5) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("vidq_fallback",)
        assert probe_redis(urls.broker_url)
        assert probe_s3(urls.s3_endpoint, ACCESS_KEY, SECRET_KEY, False)
    for url in (urls.database_url, urls.broker_url, urls.s3_endpoint):
        assert not _url_listening(url)


def test_devstack_stops_what_it_started_when_a_later_service_fails(tmp_path: Path) -> None:
    dead = free_ports(1)[0]
    stack = DevStack()
    with pytest.raises(ValueError, match="bucket name"):
        stack.start(
            tmp_path,
            database_url=f"postgresql+psycopg://postgres@127.0.0.1:{dead}/vidq",
            broker_url=f"redis://127.0.0.1:{dead}/0",
            s3_endpoint=None,
            s3_access_key=ACCESS_KEY,
            s3_secret_key=SECRET_KEY,
            bucket="x",  # too short for S3: fails after Postgres and Redis are up
        )
    assert stack.embedded == []
    assert (tmp_path / "postgres" / "PG_VERSION").exists() and (tmp_path / "redis" / "redis.log").exists()
    # postgres removes postmaster.pid on a clean shutdown; the redis-server this stack started is gone. Its pid
    # comes from its own log: the test session itself may run other redis-servers (an embedded broker).
    assert not (tmp_path / "postgres" / "postmaster.pid").exists()
    assert not _still_running(_redis_pid(tmp_path / "redis" / "redis.log"), "redis-server")
