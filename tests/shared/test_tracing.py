"""shared/infra/tracing.py without processes: off means nothing installed; the sampler of trace roots; which context a
job's message continues; the headers a message carries. The traces of real processes:
tests/integration/test_traces.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, ParentBased

from shared.infra import tracing
from shared.infra.config import Settings
from shared.messaging.broker import TaskMessage, decode, envelope
from shared.messaging.celery_app import make_celery

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_endpoint_nothing_is_installed() -> None:
    assert tracing.setup_tracing("vidq-api", Settings(otel_endpoint="")) is None
    assert tracing.active() is None
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # still the API's no-op proxy
    assert not SQLAlchemyInstrumentor().is_instrumented_by_opentelemetry
    assert not RedisInstrumentor().is_instrumented_by_opentelemetry
    assert tracing.current_traceparent() is None  # a job created now stores no trace


def test_the_endpoint_is_the_collectors_base_url_or_the_traces_url() -> None:
    assert tracing.traces_url("http://otel-collector:4318") == "http://otel-collector:4318/v1/traces"
    assert tracing.traces_url("http://otel-collector:4318/") == "http://otel-collector:4318/v1/traces"
    assert tracing.traces_url("https://tempo.example/v1/traces") == "https://tempo.example/v1/traces"


def test_a_client_call_outside_any_trace_is_not_recorded_but_inside_one_it_is() -> None:
    sampler = ParentBased(root=tracing._roots(1.0))
    tid = uuid.uuid4().int >> 64
    assert sampler.should_sample(None, tid, "SELECT", trace.SpanKind.CLIENT).decision is Decision.DROP
    assert sampler.should_sample(None, tid, "POST /v1/jobs", trace.SpanKind.SERVER).decision.is_sampled()
    parent = trace.set_span_in_context(
        trace.NonRecordingSpan(trace.SpanContext(tid, 1, is_remote=True, trace_flags=trace.TraceFlags(1)))
    )
    assert sampler.should_sample(parent, tid, "SELECT", trace.SpanKind.CLIENT).decision.is_sampled()
    none = ParentBased(root=tracing._roots(0.0))
    assert not none.should_sample(None, tid, "POST /v1/jobs", trace.SpanKind.SERVER).decision.is_sampled()


def test_a_message_continues_the_current_span_when_it_is_in_the_jobs_trace_else_the_stored_one() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # local: the process-wide provider stays unset
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    assert tracing.job_context(None) is None
    assert tracing.job_context("not a traceparent") is None

    with tracer.start_as_current_span("unrelated"):  # a sweeper tick, say: another trace
        stored = tracing.job_context(TRACEPARENT)
        assert stored is not None
        context = trace.get_current_span(stored).get_span_context()
        assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == (
            "0af7651916cd43dd8448eb211c80319c",
            "b7ad6b7169203331",
        )

    with tracer.start_as_current_span("job", context=stored), tracer.start_as_current_span("finalize"):
        assert tracing.job_context(TRACEPARENT) is None  # already in the job's trace: the current span is the parent


@dataclass(frozen=True)
class Outgoing:
    task: str
    queue: str
    job_id: uuid.UUID
    traceparent: str | None


def test_tracing_off_a_message_still_carries_its_jobs_stored_trace() -> None:
    messages = [
        Outgoing("vidq.video.generate", "video.high", uuid.uuid4(), TRACEPARENT),
        Outgoing("vidq.video.generate", "video.high", uuid.uuid4(), None),
    ]
    with tracing.publishing(messages) as headers:
        assert headers == [{"traceparent": TRACEPARENT}, {}]


def test_the_trace_headers_join_celerys_message_headers() -> None:
    celery = make_celery(Settings())
    message = TaskMessage("vidq.video.generate", uuid.uuid4(), "video.low", TRACEPARENT)
    raw = decode(envelope(celery, message, origin="test", trace_headers={"traceparent": TRACEPARENT}))
    assert raw["headers"]["traceparent"] == TRACEPARENT
    assert raw["headers"]["task"] == "vidq.video.generate"  # Celery's own headers are all still there
    assert raw["headers"]["id"]
    plain = decode(envelope(celery, message, origin="test"))
    assert "traceparent" not in plain["headers"]
