"""Traces (OpenTelemetry): one trace per job, from ``POST /v1/jobs`` to the webhook delivery.

Off unless ``VIDQ_OTEL_ENDPOINT`` names an OTLP/HTTP collector. Off, no provider is installed, nothing is
instrumented, and what remains (the stage spans of the worker, ``current_traceparent``) runs on OpenTelemetry's
no-op API. On: each process's entry point calls ``setup_tracing`` once, which installs a provider (service.name
vidq-api, vidq-worker, …) exporting in batches from a background thread (a collector that is down costs dropped
spans and a log line, never a request), and the official instrumentations of SQLAlchemy and Redis, plus FastAPI
for the API and Celery for the workers (in the pool process, ``worker_process_init``).

How the job's trace survives its hops:

- The API stores the W3C ``traceparent`` of the request that created a job in ``jobs.traceparent``.
- Every message for a job (its first send, the sweeper's re-sends and re-queues after a lost lease, a release for
  retry, each webhook hand-over) gets a PRODUCER span whose parent is the current span when that is already in the
  job's trace (a worker's finalize sending the webhook), else the stored context; the span's context goes into the
  message's ``traceparent`` header. vidq publishes with its own batched LPUSH (shared/messaging/broker.py), which
  sends none of Celery's publish signals, so the Celery instrumentation's PRODUCER span cannot be used there; its
  CONSUMER side (``run/<task>``) reads the header in the worker like any Celery message's.
- The worker's stages (claim, embeddings, denoise, decode, encode, upload, finalize) and the webhook delivery are
  spans of their own (``stage_span``): no library knows them.

A database or Redis call made outside any request, task or job (pollers, the embedding cache's monitors, the
lease heartbeat thread) would start a one-span trace of its own every few seconds: the sampler drops those.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.infra.config import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger("vidq.tracing")

TRACER = trace.get_tracer("vidq")
_W3C = TraceContextTextMapPropagator()
# Requests that are not work: probes and scrapes (regular expressions searched in the URL).
EXCLUDED_URLS = r"/healthz$,/readyz$,/metrics$"

AttributeValue = str | bool | int | float


@dataclass
class Tracing:
    """This process's provider and its one batch processor."""

    provider: TracerProvider
    processor: BatchSpanProcessor
    timeout_s: float
    _closed: bool = False

    def shutdown(self) -> None:
        """Export what is queued and stop, waiting about the export timeout at most: a collector that is down must
        not hold up a process's exit (what is left unexported then is dropped). Idempotent."""
        if self._closed:
            return
        self._closed = True
        flush = threading.Thread(target=self.provider.shutdown, name="vidq-trace-flush", daemon=True)
        flush.start()
        flush.join(self.timeout_s + 1.0)


_lock = threading.Lock()
_active: Tracing | None = None


def active() -> Tracing | None:
    """This process's tracing, or None when it is off."""
    return _active


def traces_url(endpoint: str) -> str:
    """``VIDQ_OTEL_ENDPOINT`` as the exporter's URL: the collector's base URL gets OTLP/HTTP's ``/v1/traces``."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def setup_tracing(
    service_name: str,
    settings: Settings,
    *,
    exporter: SpanExporter | None = None,
    app: FastAPI | None = None,
    celery: bool = False,
) -> Tracing | None:
    """Install this process's provider and instrumentations; None (and nothing installed) when
    ``settings.otel_endpoint`` is empty and no ``exporter`` is given. ``app``: also trace that FastAPI app's requests;
    ``celery``: also trace the tasks this process runs. Once per process: a second call returns the first's."""
    global _active
    if not settings.otel_endpoint and exporter is None:
        return None
    with _lock:
        if _active is None:
            _active = _install(service_name, settings, exporter)
        tracing = _active
    if app is not None:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(
            app, tracer_provider=tracing.provider, excluded_urls=EXCLUDED_URLS, exclude_spans=["receive", "send"]
        )
    if celery:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        instrumentor = CeleryInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=tracing.provider)
    return tracing


def _install(service_name: str, settings: Settings, exporter: SpanExporter | None) -> Tracing:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.redis import RedisInstrumentor
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, "service.namespace": "vidq"}),
        sampler=ParentBased(root=_roots(settings.otel_sample_ratio)),
        shutdown_on_exit=False,  # our own exit hook bounds the final flush by the export timeout
    )
    processor = BatchSpanProcessor(
        exporter or OTLPSpanExporter(endpoint=traces_url(settings.otel_endpoint), timeout=settings.otel_timeout_s),
        schedule_delay_millis=settings.otel_batch_delay_ms,
        export_timeout_millis=settings.otel_timeout_s * 1000,
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    # Engines are instrumented as they are created (shared/infra/db.py looks create_engine up at call time). The
    # instrumentation declares SQLAlchemy < 2.1; it hooks only engine creation and the engine events, which 2.1
    # kept, and tests/integration/test_traces.py checks its spans arrive: hence no dependency check.
    SQLAlchemyInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
    RedisInstrumentor().instrument(tracer_provider=provider)
    tracing = Tracing(provider=provider, processor=processor, timeout_s=settings.otel_timeout_s)
    atexit.register(tracing.shutdown)
    log.info("tracing on", extra={"service": service_name, "endpoint": settings.otel_endpoint or "(in process)"})
    return tracing


def _roots(ratio: float) -> Any:
    """The sampler of spans that start a trace: a client call (SQL, Redis) with no request, task or job around it
    is dropped; anything else is kept with probability ``ratio`` (decided per trace, so per job: everything that
    continues the trace follows its first span's decision)."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased

    class Roots(Sampler):
        def __init__(self) -> None:
            self._ratio = TraceIdRatioBased(ratio)

        def should_sample(
            self,
            parent_context: otel_context.Context | None,
            trace_id: int,
            name: str,
            kind: trace.SpanKind | None = None,
            attributes: Any = None,
            links: Sequence[trace.Link] | None = None,
            trace_state: trace.TraceState | None = None,
        ) -> SamplingResult:
            if kind is trace.SpanKind.CLIENT:
                return SamplingResult(Decision.DROP)
            return self._ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"VidqRoots{{ratio={ratio}}}"

    return Roots()


# --- a job's trace ---------------------------------------------------------------------------------------------------


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (the request creating a job), None when there is none (tracing off)."""
    if _active is None:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent")


def job_context(traceparent: str | None) -> otel_context.Context | None:
    """The context a job's message continues: None (the current one) when there is no stored context or the current
    span is already in the job's trace, else the stored ``traceparent``'s."""
    if not traceparent:
        return None
    stored = _W3C.extract({"traceparent": traceparent})
    stored_trace = trace.get_current_span(stored).get_span_context()
    if not stored_trace.is_valid:
        return None
    current = trace.get_current_span().get_span_context()
    if current.is_valid and current.trace_id == stored_trace.trace_id:
        return None
    return stored


class Outgoing(Protocol):
    """What ``publishing`` needs of a message (shared/messaging/broker.py ``TaskMessage``)."""

    @property
    def task(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def job_id(self) -> uuid.UUID: ...
    @property
    def traceparent(self) -> str | None: ...


@contextmanager
def publishing(messages: Sequence[Outgoing]) -> Iterator[list[dict[str, str]]]:
    """Around one publish of ``messages``: yields the trace headers of each message. Tracing on, each message has a
    PRODUCER span in its job's trace (``job_context``), open until the publish returns, and its headers carry that
    span; the Redis round trip is traced under the span when it is the only message. Tracing off, a message carries
    its job's stored traceparent as it is, so a traced worker still continues the job's trace."""
    if _active is None:
        yield [{"traceparent": m.traceparent} if m.traceparent else {} for m in messages]
        return
    spans = [
        TRACER.start_span(
            f"apply_async/{m.task}",
            context=job_context(m.traceparent),
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "celery.action": "apply_async",
                "celery.task_name": m.task,
                "messaging.system": "redis",
                "messaging.destination.name": m.queue,
                "vidq.job_id": str(m.job_id),
            },
        )
        for m in messages
    ]
    headers: list[dict[str, str]] = []
    for span in spans:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        headers.append(carrier)
    scope: AbstractContextManager[object] = (
        trace.use_span(spans[0], end_on_exit=False, record_exception=False, set_status_on_exception=False)
        if len(spans) == 1
        else nullcontext()
    )
    try:
        with scope:
            yield headers
    except BaseException as exc:
        for span in spans:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        raise
    finally:
        for span in spans:
            span.end()


def stage_span(name: str, attributes: Mapping[str, AttributeValue | None] | None = None) -> AbstractContextManager[Any]:
    """A span for a stage no library traces (claim, embeddings, denoise, …), current while its block runs; its
    exception, if any, is recorded on it. Attributes that are None are left out."""
    clean = {k: v for k, v in (attributes or {}).items() if v is not None}
    return TRACER.start_as_current_span(name, attributes=clean)


@contextmanager
def continuing(traceparent: str | None) -> Iterator[None]:
    """Run the block in the trace of the job whose stored context is ``traceparent`` (``job_context``): a worker that
    took a message of one job and claimed another (shared/jobs/fairness.py) records the claimed job's stages in that
    job's own trace."""
    context = job_context(traceparent)
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)
