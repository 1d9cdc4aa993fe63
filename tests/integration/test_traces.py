"""Traces: one trace per job, from the API's POST to the webhook delivery, across real processes.

The API and the workers here are processes of their own whose VIDQ_OTEL_ENDPOINT is a real OTLP/HTTP receiver
running in this test process (``Collector``: it decodes each ``ExportTraceServiceRequest`` as a collector would), so
every span asserted on crossed the exporter, the wire and the protobuf encoding. The rest of the suite runs with
tracing off."""

from __future__ import annotations

import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from sqlalchemy import update

from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.models import Job
from tests.integration.conftest import Receiver
from tests.integration.helpers import TINY, db_job, free_port, kill_after_test, process_env, queue_key, wait_job
from tools.processes import ProcessGroup, StartupError, vidq_argv, wait_for_log, wait_http, wait_until

STAGES = ["claim", "embeddings", "denoise", "decode", "encode", "upload", "finalize", "webhook"]


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: int
    start_ns: int
    service: str
    scope: str
    attributes: dict[str, Any]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in {"string_value", "bool_value", "int_value", "double_value"} else None


class Collector:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf), keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    collector.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        records = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    records.append(
                        SpanRecord(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            service=str(resource.get("service.name")),
                            scope=scope_spans.scope.name,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(records)

    def trace(self, trace_id: str) -> list[SpanRecord]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def of_job(self, job_id: str) -> list[SpanRecord]:
        with self.lock:
            return [s for s in self.spans if s.attributes.get("vidq.job_id") == job_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def traced(procs: ProcessGroup, collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """A traced API of the session's stack (same database and broker prefix); workers are started by each test."""
    port = free_port()
    env = {
        **procs.env,
        "VIDQ_OTEL_ENDPOINT": collector.url,
        "VIDQ_OTEL_BATCH_DELAY_MS": "200",
        "VIDQ_PUBLIC_BASE_URL": f"http://127.0.0.1:{port}",
    }
    group = ProcessGroup(env=env, log_dir=tmp_path_factory.mktemp("traced"), spawn=procs.spawn)
    group.start("api-traced", vidq_argv("api", "--no-migrate", "--port", str(port)))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", timeout_s=60, group=group)
        yield Traced(group=group, url=url)
    finally:
        group.stop_all(timeout_s=15)


@dataclass
class Traced:
    group: ProcessGroup
    url: str

    def worker(self, role: str) -> str:
        name = f"traced-{role}-{uuid.uuid4().hex[:6]}"
        self.group.start(name, vidq_argv("worker", "--role", role, "--name", name))
        wait_for_log(self.group, name, "ready.", timeout_s=120)
        if role != "webhooks":
            wait_for_log(self.group, name, "pipeline loaded", timeout_s=120)
        return name

    def stop_workers(self) -> None:
        for name in [n for n in self.group.procs if n.startswith("traced-")]:
            kill_after_test(self.group, name)


@pytest.fixture
def traced_client(traced: Traced, tenant_key: dict[str, str]) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {tenant_key['api_key']}"}
    with httpx.Client(base_url=traced.url, headers=headers, timeout=30) as c:
        yield c
    traced.stop_workers()


def job_trace_id(settings: Settings, job_id: str) -> str:
    traceparent = db_job(settings, job_id).traceparent
    assert traceparent is not None, "the API stored no trace context with the job"
    version, trace_id, _span_id, _flags = traceparent.split("-")
    assert version == "00"
    return trace_id


def wait_for_trace(
    collector: Collector,
    trace_id: str,
    names: list[str],
    *,
    counts: dict[str, int] | None = None,
    timeout_s: float = 60,
) -> list[SpanRecord]:
    """The trace once it is whole: every one of ``names`` arrived (``counts`` of some), and so did the parent of
    every span. Each process exports a span when it ends, in batches, so a child (which ends first) often arrives a
    batch before its parent: a trace read as soon as its stage spans are in can still miss a parent. A parent that
    never arrives fails here, at the deadline, naming what is missing."""
    missing: list[str] = []

    def whole() -> bool:
        spans = collector.trace(trace_id)
        ids = {s.span_id for s in spans}
        seen = [s.name for s in spans]
        missing[:] = [n for n in names if n not in seen]
        missing.extend(f"{n} ×{k - seen.count(n)}" for n, k in (counts or {}).items() if seen.count(n) < k)
        missing.extend(f"the parent of {s.name}" for s in spans if s.parent_id and s.parent_id not in ids)
        return not missing

    try:
        wait_until(whole, timeout_s=timeout_s, what=f"trace {trace_id}")
    except StartupError as exc:
        raise AssertionError(f"trace {trace_id} never became whole; missing: {missing}") from exc
    return collector.trace(trace_id)


def stage(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {len(found)} spans, expected 1"
    return found[0]


def test_one_trace_from_the_post_to_the_webhook(
    traced: Traced, traced_client: httpx.Client, collector: Collector, settings: Settings, receiver: Receiver
) -> None:
    traced.worker("video")
    traced.worker("webhooks")
    job = traced_client.post("/v1/jobs", json={**TINY, "webhook_url": receiver.url}).raise_for_status().json()
    done = wait_job(traced_client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert receiver.event.wait(30), "webhook never delivered"
    trace_id = job_trace_id(settings, job["id"])
    spans = wait_for_trace(collector, trace_id, STAGES)

    # Every span of the job, whichever process made it, is in the one trace the API started.
    assert {s.trace_id for s in collector.of_job(job["id"])} == {trace_id}
    roots = [s for s in spans if not s.parent_id]
    assert [(r.name, r.kind, r.service) for r in roots] == [("POST /v1/jobs", PbSpan.SPAN_KIND_SERVER, "vidq-api")]
    ids = {s.span_id for s in spans}
    assert all(s.parent_id in ids for s in spans if s.parent_id), "a span's parent is missing from the trace"

    # Each stage once, in the order the job went through them, with the job's attributes.
    stages = [stage(spans, name) for name in STAGES]
    starts = [s.start_ns for s in stages]
    assert starts == sorted(starts), [s.name for s in sorted(stages, key=lambda s: s.start_ns)]
    assert all(s.attributes["vidq.job_id"] == job["id"] for s in stages)
    claim, denoise, webhook = stage(spans, "claim"), stage(spans, "denoise"), stage(spans, "webhook")
    assert claim.attributes["vidq.attempt"] == 1
    assert claim.attributes["vidq.queue"] == job["queue"]
    assert denoise.attributes["vidq.steps"] == TINY["steps"]
    assert denoise.attributes["vidq.model"] == "tiny-wan"
    assert webhook.attributes["http.response.status_code"] == 204
    assert webhook.attributes["vidq.webhook.outcome"] == "delivered"
    assert (claim.service, denoise.service, webhook.service) == ("vidq-worker", "vidq-worker", "vidq-webhooks")

    # The hops: API → video queue → worker, worker's finalize → webhook queue → webhook worker.
    by_id = {s.span_id: s for s in spans}
    publishes = [s for s in spans if s.kind == PbSpan.SPAN_KIND_PRODUCER]
    assert sorted((p.name, p.service) for p in publishes) == [
        ("apply_async/vidq.video.generate", "vidq-api"),
        ("apply_async/vidq.webhooks.deliver", "vidq-worker"),
    ]
    assert by_id[claim.parent_id].name == "run/vidq.video.generate"
    assert by_id[by_id[claim.parent_id].parent_id].name == "apply_async/vidq.video.generate"
    assert by_id[webhook.parent_id].name == "run/vidq.webhooks.deliver"
    assert by_id[by_id[webhook.parent_id].parent_id].name == "apply_async/vidq.webhooks.deliver"
    assert by_id[by_id[by_id[webhook.parent_id].parent_id].parent_id].name == "finalize"

    # The libraries' own spans are in it too: the HTTP server, Celery, SQLAlchemy, Redis.
    scopes = {s.scope for s in spans}
    for library in ("fastapi", "celery", "sqlalchemy", "redis"):
        assert f"opentelemetry.instrumentation.{library}" in scopes, (library, scopes)
    sql_in_claim = [s for s in spans if s.parent_id == claim.span_id and s.scope.endswith("sqlalchemy")]
    assert sql_in_claim, "the claim's UPDATE is not under the claim span"
    # The fixture polled /readyz before the POST; the API exports its spans in order, so they would be here by now.
    with collector.lock:
        assert not [s for s in collector.spans if s.name.startswith(("GET /readyz", "GET /healthz"))]


def test_a_message_sent_again_by_the_sweeper_continues_the_jobs_trace(
    traced: Traced, traced_client: httpx.Client, collector: Collector, settings: Settings
) -> None:
    # No worker yet: the message the API sends is lost (deleted here), as if the broker had dropped it.
    job = traced_client.post("/v1/jobs", json={**TINY, "seed": 2}).raise_for_status().json()
    client = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)
    key = queue_key(settings, job["queue"])
    wait_until(lambda: client.llen(key) == 1, timeout_s=10, what="the job's message")
    wait_until(lambda: db_job(settings, job["id"]).enqueued_at is not None, timeout_s=10, what="the send on record")
    client.delete(key)
    with session_scope(settings) as session:  # never sent, as far as the sweeper can tell
        session.execute(update(Job).where(Job.id == uuid.UUID(job["id"])).values(enqueued_at=None))

    # A traced sweeper (its own process, as in production) sends it again; a worker then runs it.
    sweep = subprocess.run(vidq_argv("sweep", "--once"), env=traced.group.env, capture_output=True, timeout=60)
    assert sweep.returncode == 0, sweep.stderr.decode()
    assert client.llen(key) == 1
    traced.worker("all")
    done = wait_job(traced_client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]

    trace_id = job_trace_id(settings, job["id"])
    spans = wait_for_trace(collector, trace_id, STAGES[:-1])  # no webhook URL
    assert {s.trace_id for s in collector.of_job(job["id"])} == {trace_id}
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if not s.parent_id)
    assert root.name == "POST /v1/jobs"
    sends = sorted((s.service, by_id[s.parent_id].name) for s in spans if s.name == "apply_async/vidq.video.generate")
    # Both sends hang off the request that created the job: the API's own, and the sweeper's from the stored context.
    assert sends == [("vidq-api", "POST /v1/jobs"), ("vidq-sweeper", "POST /v1/jobs")]
    claim = stage(spans, "claim")
    consumer = by_id[claim.parent_id]
    assert by_id[consumer.parent_id].service == "vidq-sweeper"  # the run came from the sweeper's message


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A collector that accepts connections and never answers (the worst outage: every export waits its timeout)."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_collector_that_never_answers_changes_nothing_for_the_job(
    procs: ProcessGroup, black_hole: str, tenant_key: dict[str, str], receiver: Receiver, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **procs.env,
        "VIDQ_OTEL_ENDPOINT": black_hole,
        "VIDQ_OTEL_TIMEOUT_S": "1",
        "VIDQ_OTEL_BATCH_DELAY_MS": "50",
        "VIDQ_PUBLIC_BASE_URL": f"http://127.0.0.1:{port}",
    }
    group = ProcessGroup(env=env, log_dir=tmp_path, spawn=procs.spawn)
    try:
        group.start("api-blackhole", vidq_argv("api", "--no-migrate", "--port", str(port)))
        group.start("worker-blackhole", vidq_argv("worker", "--role", "all", "--name", f"blackhole-{port}"))
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=60, group=group)
        wait_for_log(group, "worker-blackhole", "pipeline loaded", timeout_s=120)
        headers = {"Authorization": f"Bearer {tenant_key['api_key']}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
            jobs = [client.post("/v1/jobs", json={**TINY, "seed": s, "webhook_url": receiver.url}) for s in (3, 4)]
            assert [r.status_code for r in jobs] == [202, 202]
            for r in jobs:
                done = wait_job(client, r.json()["id"], {"succeeded", "failed"})
                assert done["status"] == "succeeded", done["error"]
                assert done["attempt"] == 1
        wait_until(lambda: len(receiver.requests) == 2, timeout_s=30, what="both webhooks")
        for name in ("api-blackhole", "worker-blackhole"):  # tracing was on, and its exports were failing
            wait_for_log(group, name, "Failed to export spans", timeout_s=30)
    finally:
        group.stop_all(timeout_s=15)


def test_every_attempt_of_a_job_and_its_webhook_are_one_trace(
    traced: Traced, traced_client: httpx.Client, collector: Collector, settings: Settings, receiver: Receiver
) -> None:
    # An encoder-free worker and no prewarmer: each attempt gives the job back (embeddings_unavailable), and the
    # worker's release sends it again, until max_attempts fails it and its webhook goes out.
    with process_env(traced.group, VIDQ_WORKER_TEXT_ENCODER="remote", VIDQ_WORKER_REMOTE_ENCODE_TIMEOUT_S="0.5"):
        traced.worker("all")
    prompt = f"a lighthouse nobody has encoded yet {uuid.uuid4().hex}"
    job = traced_client.post("/v1/jobs", json={**TINY, "prompt": prompt, "webhook_url": receiver.url}).json()
    done = wait_job(traced_client, job["id"], {"succeeded", "failed"})
    assert (done["status"], done["error"]["code"]) == ("failed", "embeddings_unavailable")
    attempts = settings.max_attempts
    assert done["attempt"] == attempts
    assert receiver.event.wait(30), "webhook never delivered"

    trace_id = job_trace_id(settings, job["id"])
    spans = wait_for_trace(collector, trace_id, ["webhook"], counts={"claim": attempts})  # every attempt's claim
    assert {s.trace_id for s in collector.of_job(job["id"])} == {trace_id}
    assert [s.name for s in spans if not s.parent_id] == ["POST /v1/jobs"]
    by_id = {s.span_id: s for s in spans}
    claims = sorted((s for s in spans if s.name == "claim"), key=lambda s: s.start_ns)
    assert [c.attributes["vidq.attempt"] for c in claims] == list(range(1, attempts + 1))
    # Attempt 1 came from the API's send, each later one from the worker's release of the one before.
    senders = [by_id[by_id[c.parent_id].parent_id].service for c in claims]
    assert senders == ["vidq-api"] + ["vidq-worker"] * (attempts - 1)
    assert len([s for s in spans if s.name == "embeddings"]) == attempts
    webhook = stage(spans, "webhook")
    assert webhook.attributes["vidq.event"] == "job.failed"
    assert webhook.start_ns > claims[-1].start_ns
