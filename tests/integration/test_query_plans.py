"""Every query the API and the sweeper send is index-driven: on a table of 200,000 jobs (benchmarks/db_data.py's
steady state, a few rows of each kind made due), EXPLAIN ANALYZE of the very SQL each function sends shows the
intended index, no sequential scan of ``jobs``, and a number of rows read bounded by the page or by the work due,
not by the table. Then the webhook mark's life: set by the finishing UPDATE, handed over and given up by the
sweeper."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, text, update

from benchmarks.db_data import RUNNING, capture_sql, explain, fill, plan_line, plan_nodes
from services.api.jobs_service import create_job, decode_cursor, encode_cursor
from services.api.store import list_query, result_source_query
from services.sweeper.sweeper import _expire_keys, _promote_due, _webhooks_due
from shared.config import Settings
from shared.db import get_engine, session_factory, session_scope
from shared.models import Job
from shared.schemas import JobCreate
from shared.states import (
    JobStatus,
    claim,
    expired_leases,
    fail,
    has_status,
    request_cancel,
    succeed,
    unsent_or_lost,
)
from shared.tenants import get_or_create_tenant
from tests.integration.helpers import TINY, sweeper

JOBS = 200_000
DUE = 5  # rows made due of each kind
PAGE = 100
_TRUNCATE = "TRUNCATE jobs, job_transitions, idempotency_keys, webhook_deliveries, api_keys, tenants CASCADE"

# Each made-due change touches DUE rows of the steady state.
_MAKE_DUE = [
    # expired leases
    "UPDATE jobs SET lease_expires_at = now() - interval '1 min' WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'running' LIMIT %(n)s)",
    # never sent
    "UPDATE jobs SET enqueued_at = NULL WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'queued' AND queue = 'video.high' ORDER BY created_at LIMIT %(n)s)",
    # sent two hours ago, never claimed (and overdue for aging)
    "UPDATE jobs SET enqueued_at = now() - interval '2 hours' WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'queued' AND queue = 'video.low' ORDER BY created_at LIMIT %(n)s)",
    # finished with a webhook, no attempt on record; two more beyond the give-up age
    "UPDATE jobs SET webhook_pending_since = now() - interval '10 min' WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'failed' AND webhook_url IS NOT NULL LIMIT %(n)s)",
    "UPDATE jobs SET webhook_pending_since = now() - interval '2 days' WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'cancelled' AND webhook_url IS NOT NULL LIMIT 2)",
    # expired idempotency keys
    "UPDATE idempotency_keys SET expires_at = now() - interval '1 min' WHERE key IN "
    "(SELECT key FROM idempotency_keys LIMIT %(n)s)",
]


# Every job has a result key, as every job the API creates since migration 0004 (the fill predates the column);
# one request of the largest tenant was served HOT_REPEATS times (a hot key: its lookup must still read one entry).
HOT_KEY = "f" * 64
HOT_REPEATS = 1000
_RESULT_KEYS = [
    "UPDATE jobs SET result_key = encode(sha256(id::text::bytea), 'hex')",
    "UPDATE jobs SET result_key = %(hot)s WHERE id IN "
    "(SELECT id FROM jobs WHERE tenant_id = %(tenant)s AND status = 'succeeded' LIMIT %(n)s)",
]


def _truncate(settings: Settings) -> None:
    with get_engine(settings).begin() as conn:
        conn.execute(text(_TRUNCATE))


@pytest.fixture(scope="module")
def tenants(settings: Settings) -> Iterator[list[uuid.UUID]]:
    """The filled table, for this module's plan tests; emptied before and after (clean_state's pattern, but once
    for the module: the fill takes seconds)."""
    _truncate(settings)
    with psycopg.connect(settings.sqlalchemy_url.replace("+psycopg", "")) as conn:
        conn.execute("SET synchronous_commit = off")
        ids = fill(conn, jobs=JOBS, chunk=100_000, say=lambda _: None)
        for sql in _RESULT_KEYS:
            conn.execute(sql, {"hot": HOT_KEY, "tenant": ids[0], "n": HOT_REPEATS})
        conn.commit()
        conn.autocommit = True  # VACUUM runs outside a transaction: the table as fill() leaves it, keys included
        conn.execute("VACUUM (ANALYZE) jobs")
        conn.autocommit = False
        for sql in _MAKE_DUE:
            conn.execute(sql, {"n": DUE})
        conn.commit()
        conn.execute("ANALYZE jobs, idempotency_keys")
    yield ids
    _truncate(settings)


def _plans(settings: Settings, call: Callable[[Any], object]) -> list[dict[str, Any]]:
    """EXPLAIN ANALYZE of each statement ``call(session)`` sends (its own work rolled back)."""
    engine = get_engine(settings)
    session = session_factory(settings)()
    try:
        sent = capture_sql(engine, lambda: call(session))
    finally:
        session.rollback()
        session.close()
    with engine.connect() as conn:
        return [explain(conn, statement, params) for statement, params in sent]


def _read(plan: dict[str, Any], index: str) -> int:
    """Rows the scan of ``index`` read: those it returned plus those a filter threw away. No plan scans a whole
    table."""
    _assert_no_seq_scan(plan)
    (node,) = [n for n in plan_nodes(plan) if n.get("Index Name") == index]
    assert node["Node Type"] in {"Index Scan", "Index Only Scan", "Bitmap Index Scan"}, plan_line(plan)
    return int(node["Actual Rows"] * node["Actual Loops"] + node.get("Rows Removed by Filter", 0))


def _assert_no_seq_scan(plan: dict[str, Any]) -> None:
    seq = [n for n in plan_nodes(plan) if n["Node Type"] == "Seq Scan"]
    assert not seq, plan_line(plan)


def _cursor_at(settings: Settings, tenant: uuid.UUID, depth: int) -> str:
    with session_scope(settings) as session:
        job = session.execute(
            select(Job).where(Job.tenant_id == tenant).order_by(Job.created_at.desc(), Job.id.desc()).offset(depth)
        ).scalar()
        assert job is not None
        return encode_cursor(job)


@pytest.mark.parametrize(
    ("status", "depth", "indexes", "most"),
    [
        (None, None, {"ix_jobs_tenant_newest"}, PAGE + 1),
        (None, 50_000, {"ix_jobs_tenant_newest"}, PAGE + 1),
        (JobStatus.FAILED, None, {"ix_jobs_tenant_status_newest"}, PAGE + 1),
        (JobStatus.FAILED, 5_000, {"ix_jobs_tenant_status_newest"}, PAGE + 1),
        # 92% of jobs: the planner may as well read the tenant index and skip the few others.
        (JobStatus.SUCCEEDED, 50_000, {"ix_jobs_tenant_status_newest", "ix_jobs_tenant_newest"}, 2 * (PAGE + 1)),
    ],
)
def test_a_list_page_reads_one_page_of_its_index_at_any_depth(settings, tenants, status, depth, indexes, most):
    cursor = _cursor_at(settings, tenants[0], depth) if depth else None
    sql, params = list_query(
        tenant_id=tenants[0], status=status, limit=PAGE + 1, after=decode_cursor(cursor) if cursor else None
    )
    with get_engine(settings).connect() as conn:
        plan = explain(conn, sql, params)
    (index,) = {n["Index Name"] for n in plan_nodes(plan) if "Index Name" in n} & indexes
    assert PAGE + 1 <= _read(plan, index) <= most, plan_line(plan)
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)  # read in ORDER BY's order


@pytest.mark.parametrize("depth", [None, 50_000])
def test_an_oldest_first_page_reads_the_same_index_backwards(settings, tenants, depth):
    """GET /v1/videos?order=asc: the tenant index read in the other direction, one page at any depth, no sort."""
    after = decode_cursor(_cursor_at(settings, tenants[0], depth)) if depth else None
    sql, params = list_query(tenant_id=tenants[0], status=None, limit=PAGE + 1, after=after, ascending=True)
    with get_engine(settings).connect() as conn:
        plan = explain(conn, sql, params)
    assert _read(plan, "ix_jobs_tenant_newest") == PAGE + 1, plan_line(plan)
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)


def test_the_result_cache_lookup_reads_one_entry_of_its_index(settings, tenants):
    """The submit's lookup: this tenant's newest succeeded job with this key, one entry of ix_jobs_result_cache read
    (in the index's own order, no sort), for a key served a thousand times, a key of one job, and no match."""
    with session_scope(settings) as session:
        one = session.execute(
            select(Job.tenant_id, Job.result_key).where(has_status(JobStatus.SUCCEEDED)).limit(1)
        ).one()
    cases = [(tenants[0], HOT_KEY, 1), (one.tenant_id, one.result_key, 1), (tenants[1], HOT_KEY, 0)]
    for tenant_id, key, found in cases:
        sql, params = result_source_query(tenant_id=tenant_id, result_key=key)
        with get_engine(settings).connect() as conn:
            plan = explain(conn, sql, params)
        assert _read(plan, "ix_jobs_result_cache") == found, plan_line(plan)
        assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)


def test_sweeper_queries_read_what_is_due_not_the_table(settings, tenants):
    with session_scope(settings) as session:
        now = session.execute(select(func.now())).scalar_one()
    # Expired leases: the running set (one row per GPU), whatever the size of the table.
    (plan,) = _plans(settings, lambda s: expired_leases(s, now=now))
    # (A bitmap scan also counts the entries the made-due UPDATE left behind, until vacuum: + DUE.)
    assert _read(plan, "ix_jobs_running") <= RUNNING + DUE, plan_line(plan)
    # Never sent, then lost: one range scan of each queued index.
    unsent, lost = _plans(settings, lambda s: unsent_or_lost(s, now=now, grace_s=10, resend_s=1800))
    assert _read(unsent, "ix_jobs_queued_unsent") == DUE, plan_line(unsent)
    assert _read(lost, "ix_jobs_queued_sent") == DUE, plan_line(lost)
    # Aging: the queued jobs below high whose last send is older than the threshold.
    (plan,) = _plans(settings, lambda s: _promote_due(s, now=now, after_s=300))
    assert _read(plan, "ix_jobs_queued_agable") == DUE, plan_line(plan)
    # Webhooks: the marked jobs only (the recent ones and those to give up).
    (plan,) = _plans(settings, lambda s: _webhooks_due(s, now=now, grace_s=60))
    assert _read(plan, "ix_jobs_webhook_pending") == DUE + 2, plan_line(plan)
    # Idempotency keys: a batch by expiry, each deleted through the primary key.
    (plan,) = _plans(settings, lambda s: _expire_keys(s, now=now, limit=1000))
    assert _read(plan, "ix_idempotency_keys_expires_at") == DUE, plan_line(plan)
    assert _read(plan, "idempotency_keys_pkey") == DUE, plan_line(plan)


def test_the_models_indexes_are_the_migrations(settings):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from shared.models import Base

    with get_engine(settings).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert [d for d in diff if "index" in str(d[0]) or "column" in str(d[0])] == []


# --- the webhook mark ---------------------------------------------------------------------------------------


def _job(settings: Settings, **body: Any) -> uuid.UUID:
    with session_scope(settings) as session:
        tenant = get_or_create_tenant(session, "plans")
        return create_job(session, settings, tenant=tenant, body=JobCreate(**{**TINY, **body})).id


def _mark(settings: Settings, job_id: uuid.UUID) -> Any:
    with session_scope(settings) as session:
        return session.execute(select(Job.webhook_pending_since).where(Job.id == job_id)).scalar_one()


def test_finishing_a_job_with_a_webhook_marks_it_in_the_same_update(settings, clean_state):
    url = "https://example.com/hook"
    succeeded, failed, cancelled = _job(settings, webhook_url=url), _job(settings), _job(settings, webhook_url=url)
    with session_scope(settings) as session:
        running = claim(session, succeeded, worker_id="w", lease_s=30)
        assert running is not None and running.webhook_pending_since is None  # nothing to deliver yet
        assert succeed(session, succeeded, token=running.attempt, output={}) is not None
        assert fail(session, failed, token=None, code="x", message="y") is not None
        request_cancel(session, cancelled, tenant_id=running.tenant_id)
    assert _mark(settings, succeeded) is not None and _mark(settings, cancelled) is not None
    assert _mark(settings, failed) is None  # no URL: nothing to deliver, and not in the index


def test_the_sweeper_hands_marked_jobs_over_and_gives_up_after_a_day(settings, clean_state):
    recent, stale = _job(settings, webhook_url="https://example.com/h"), _job(settings, webhook_url="https://e.x/h")
    with session_scope(settings) as session:
        for job_id, age in ((recent, timedelta(minutes=5)), (stale, timedelta(days=2))):
            fail(session, job_id, token=None, code="x", message="y")
            session.execute(update(Job).where(Job.id == job_id).values(webhook_pending_since=func.now() - age))
    report = sweeper(settings).sweep_once()
    assert report.webhooks == [recent]
    assert _mark(settings, stale) is None  # given up: out of the index
    assert _mark(settings, recent) is not None  # still marked until an attempt is on record
