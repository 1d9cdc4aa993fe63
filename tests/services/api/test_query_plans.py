"""Every query the API's store sends is index-driven: on a table of 200,000 jobs (benchmarks/db_data.py's steady
state), EXPLAIN ANALYZE of the very SQL each function sends shows the intended index, no sequential scan of
``jobs``, and a number of rows read bounded by the page, not by the table nor by other tenants' rows. The
sweeper's queries: tests/services/sweeper/test_query_plans.py."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select

from benchmarks.db_data import explain, plan_line, plan_nodes
from services.api.pagination import decode_cursor, encode_cursor
from services.api.store import list_query, result_source_query
from shared.infra.config import Settings
from shared.infra.db import get_engine, session_scope
from shared.jobs.repository import has_status
from shared.jobs.status import JobStatus
from shared.models import Job, WebhookDelivery
from shared.webhooks.deliveries import failing
from tests.services.query_plans import FEW_FAILING, HOT_KEY, FilledDatabase, plans, read

PAGE = 100


def _cursor_at(settings: Settings, tenant: uuid.UUID, depth: int) -> str:
    with session_scope(settings) as session:
        job = session.execute(
            select(Job).where(Job.tenant_id == tenant).order_by(Job.created_at.desc(), Job.id.desc()).offset(depth)
        ).scalar()
        assert job is not None
        return encode_cursor(job.created_at, job.id)


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
def test_a_list_page_reads_one_page_of_its_index_at_any_depth(filled: FilledDatabase, status, depth, indexes, most):
    settings, tenants = filled.settings, filled.tenants
    cursor = _cursor_at(settings, tenants[0], depth) if depth else None
    sql, params = list_query(
        tenant_id=tenants[0], status=status, limit=PAGE + 1, after=decode_cursor(cursor) if cursor else None
    )
    with get_engine(settings).connect() as conn:
        plan = explain(conn, sql, params)
    (index,) = {n["Index Name"] for n in plan_nodes(plan) if "Index Name" in n} & indexes
    assert PAGE + 1 <= read(plan, index) <= most, plan_line(plan)
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)  # read in ORDER BY's order


@pytest.mark.parametrize("depth", [None, 50_000])
def test_an_oldest_first_page_reads_the_same_index_backwards(filled: FilledDatabase, depth):
    """GET /v1/videos?order=asc: the tenant index read in the other direction, one page at any depth, no sort."""
    settings, tenants = filled.settings, filled.tenants
    after = decode_cursor(_cursor_at(settings, tenants[0], depth)) if depth else None
    sql, params = list_query(tenant_id=tenants[0], status=None, limit=PAGE + 1, after=after, ascending=True)
    with get_engine(settings).connect() as conn:
        plan = explain(conn, sql, params)
    assert read(plan, "ix_jobs_tenant_newest") == PAGE + 1, plan_line(plan)
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)


def test_the_result_cache_lookup_reads_one_entry_of_its_index(filled: FilledDatabase):
    """The submit's lookup: this tenant's newest succeeded job with this key, one entry of ix_jobs_result_cache read
    (in the index's own order, no sort), for a key served a thousand times, a key of one job, and no match."""
    settings, tenants = filled.settings, filled.tenants
    with session_scope(settings) as session:
        one = session.execute(
            select(Job.tenant_id, Job.result_key).where(has_status(JobStatus.SUCCEEDED)).limit(1)
        ).one()
    cases = [(tenants[0], HOT_KEY, 1), (one.tenant_id, one.result_key, 1), (tenants[1], HOT_KEY, 0)]
    for tenant_id, key, found in cases:
        sql, params = result_source_query(tenant_id=tenant_id, result_key=key)
        with get_engine(settings).connect() as conn:
            plan = explain(conn, sql, params)
        assert read(plan, "ix_jobs_result_cache") == found, plan_line(plan)
        assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)


def _failing_cursor(settings: Settings, tenant: uuid.UUID, state: str, depth: int) -> int:
    planned = WebhookDelivery.next_attempt_at.is_not(None)
    with session_scope(settings) as session:
        found = session.execute(
            select(WebhookDelivery.id)
            .where(
                WebhookDelivery.tenant_id == tenant,
                ~WebhookDelivery.ok,
                ~WebhookDelivery.superseded,
                planned if state == "retrying" else ~planned,
            )
            .order_by(WebhookDelivery.id.desc())
            .offset(depth)
        ).scalar()
        assert found is not None
        return found


@pytest.mark.parametrize("state", ["failed", "retrying"])
@pytest.mark.parametrize(
    ("which", "depth", "expected"), [(0, None, FEW_FAILING), (1, None, PAGE + 1), (1, 2_000, PAGE + 1)]
)
def test_a_failing_deliveries_page_reads_one_page_of_its_tenants_index(
    filled: FilledDatabase, state, which, depth, expected
):
    """GET /v1/webhooks/deliveries: the tenant's index of the state read in its own order (no sort), one page at
    any depth, and no more than its own few entries for a tenant whose failures are few among the thousands of the
    other tenants'."""
    settings, tenant = filled.settings, filled.tenants[which]
    with session_scope(settings) as session:
        others = session.execute(
            select(func.count()).where(WebhookDelivery.tenant_id != tenant, ~WebhookDelivery.ok)
        ).scalar_one()
    assert others > 20 * PAGE  # the page is found among many more failures of other tenants
    before_id = _failing_cursor(settings, tenant, state, depth) if depth else None
    (plan,) = plans(settings, lambda s: failing(s, tenant_id=tenant, state=state, limit=PAGE + 1, before_id=before_id))
    assert read(plan, f"ix_webhook_deliveries_tenant_{state}") == expected, plan_line(plan)
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)
