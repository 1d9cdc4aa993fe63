"""Every query the sweeper sends is index-driven: on a table of 200,000 jobs (benchmarks/db_data.py's steady
state, a few rows of each kind made due), EXPLAIN ANALYZE of the very SQL each step sends shows the intended index,
no sequential scan of ``jobs``, and a number of rows read bounded by the work due, not by the table. The API's
queries: tests/services/api/test_query_plans.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import event, func, select, text

from benchmarks.db_data import RUNNING, plan_line
from shared.infra.db import get_engine, session_scope
from shared.jobs.repository import expire_keys, expired_leases, promotion_due, unsent_or_lost, webhooks_due
from shared.pools.breaker import FAILURE_WINDOW
from shared.pools.store import waiting_pools
from shared.webhooks.deliveries import retries_due
from tests.services.query_plans import DUE, FilledDatabase, plans, read


def test_sweeper_queries_read_what_is_due_not_the_table(filled: FilledDatabase):
    settings = filled.settings
    with session_scope(settings) as session:
        now = session.execute(select(func.now())).scalar_one()
    # Expired leases: the running set (one row per GPU), whatever the size of the table.
    (plan,) = plans(settings, lambda s: expired_leases(s, now=now, limit=100))
    # (A bitmap scan also counts the entries the made-due UPDATE left behind, until vacuum: + DUE.)
    assert read(plan, "ix_jobs_running") <= RUNNING + DUE, plan_line(plan)
    # Never sent, then lost: one range scan of each queued index.
    unsent, lost = plans(settings, lambda s: unsent_or_lost(s, now=now, grace_s=10, resend_s=1800, limit=100))
    assert read(unsent, "ix_jobs_queued_unsent") == DUE, plan_line(unsent)
    assert read(lost, "ix_jobs_queued_sent") == DUE, plan_line(lost)
    # Aging: the queued jobs below high whose last send is older than the threshold.
    (plan,) = plans(settings, lambda s: promotion_due(s, now=now, after_s=300, limit=100))
    assert read(plan, "ix_jobs_queued_agable") == DUE, plan_line(plan)
    # Webhooks: the marked jobs only (the recent ones and those to give up).
    (plan,) = plans(settings, lambda s: webhooks_due(s, now=now, grace_s=60, limit=100))
    assert read(plan, "ix_jobs_webhook_pending") == DUE + 2, plan_line(plan)
    # Idempotency keys: a batch by expiry, each deleted through the primary key.
    (plan,) = plans(settings, lambda s: expire_keys(s, now=now, limit=1000))
    assert read(plan, "ix_idempotency_keys_expires_at") == DUE, plan_line(plan)
    assert read(plan, "idempotency_keys_pkey") == DUE, plan_line(plan)
    # Worker pools: which pools other than stable hold queued jobs (the pooled index holds none here, however many
    # stable jobs wait), and a pool's breaker window (its own finished jobs, by time).
    queued_pools, _ = plans(settings, waiting_pools)
    assert read(queued_pools, "ix_jobs_queued_pooled") == 0, plan_line(queued_pools)
    window = {"pool": "canary", "window": 600.0, "since": now}
    (plan,) = plans(settings, lambda s: s.execute(FAILURE_WINDOW, window))
    assert read(plan, "ix_jobs_pool_finished") == 0, plan_line(plan)


def test_sweeper_reads_only_the_due_index(settings, clean_state):
    """The sweeper's step reads ix_webhook_deliveries_due (its predicate is provable from the query), so a tick
    costs O(due), however many attempts the table holds. Seq scans are disabled: on a tiny table the planner
    would rightly prefer one, and the point is that the index can serve the very SQL the step sends."""
    engine = get_engine(settings)
    sent: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        sent.append((statement, params))

    with session_scope(settings) as session:
        event.listen(engine, "before_cursor_execute", capture)
        try:
            retries_due(session, now=datetime.now(UTC), grace_s=60, limit=100)
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        (statement, params) = [s for s in sent if "webhook_deliveries" in s[0]][-1]
        session.execute(text("SET LOCAL enable_seqscan = off"))
        cursor = session.connection().connection.cursor()
        cursor.execute(f"EXPLAIN {statement}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "ix_webhook_deliveries_due" in plan, plan
