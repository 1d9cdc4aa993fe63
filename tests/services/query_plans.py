"""What the query-plan tests of the API (tests/services/api/test_query_plans.py) and of the sweeper
(tests/services/sweeper/test_query_plans.py) share: a ``jobs`` table of 200,000 rows (benchmarks/db_data.py's
steady state, a few rows of each kind made due, several tenants' failing webhook deliveries) and the reading of
EXPLAIN ANALYZE plans."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from benchmarks.db_data import capture_sql, explain, fill, plan_line, plan_nodes
from shared.infra.config import Settings, get_settings
from shared.infra.db import get_engine, session_factory
from shared.infra.migrate import upgrade

JOBS = 200_000
DUE = 5  # rows made due of each kind

# Each made-due change touches DUE rows of the steady state.
_MAKE_DUE = [
    # expired leases
    "UPDATE jobs SET lease_expires_at = now() - interval '1 min' WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'running' LIMIT %(n)s)",
    # never sent
    "UPDATE jobs SET enqueued_at = NULL WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'queued' AND priority_class = 'high' ORDER BY created_at LIMIT %(n)s)",
    # sent two hours ago, never claimed (and overdue for aging)
    "UPDATE jobs SET enqueued_at = now() - interval '2 hours' WHERE id IN "
    "(SELECT id FROM jobs WHERE status = 'queued' AND priority_class = 'low' ORDER BY created_at LIMIT %(n)s)",
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


# Failing webhook deliveries (GET /v1/webhooks/deliveries): every delivery of the three smaller tenants failed, half
# given up and half with a retry planned (thousands of each); the largest tenant has FEW_FAILING of each state only,
# so its page is found among the others' failures by the index alone.
FEW_FAILING = 3
_FAILING_DELIVERIES = [
    "UPDATE webhook_deliveries SET ok = false, status_code = 500, "
    "next_attempt_at = CASE WHEN id %% 2 = 0 THEN now() + interval '1 hour' END WHERE tenant_id <> %(tenant)s",
    "UPDATE webhook_deliveries SET ok = false, status_code = 500 WHERE id IN "
    "(SELECT id FROM webhook_deliveries WHERE tenant_id = %(tenant)s ORDER BY id LIMIT %(few)s)",
    "UPDATE webhook_deliveries SET ok = false, status_code = 500, next_attempt_at = now() + interval '1 hour' "
    "WHERE id IN (SELECT id FROM webhook_deliveries WHERE tenant_id = %(tenant)s ORDER BY id DESC LIMIT %(few)s)",
]


@dataclass(frozen=True)
class FilledDatabase:
    settings: Settings  # the session's settings, pointing at the filled database
    tenants: list[uuid.UUID]  # largest first


def filled_database(session_url: str) -> Iterator[FilledDatabase]:
    """The body of a session fixture: a database next to the session's (``<name>_plans``), migrated and filled
    once, dropped at the end."""
    from tests.conftest import _drop_database
    from tools.devstack import ensure_database

    base, _, name = session_url.rpartition("/")
    url = f"{base}/{name}_plans"
    ensure_database(url)
    settings = get_settings().model_copy(update={"database_url": url})
    try:
        upgrade(settings)
        with psycopg.connect(settings.sqlalchemy_url.replace("+psycopg", "")) as conn:
            conn.execute("SET synchronous_commit = off")
            ids = fill(conn, jobs=JOBS, chunk=100_000, say=lambda _: None)
            for sql in _RESULT_KEYS:
                conn.execute(sql, {"hot": HOT_KEY, "tenant": ids[0], "n": HOT_REPEATS})
            for sql in _FAILING_DELIVERIES:
                conn.execute(sql, {"tenant": ids[0], "few": FEW_FAILING})
            conn.commit()
            conn.autocommit = True  # VACUUM runs outside a transaction: the table as fill() leaves it, keys included
            conn.execute("VACUUM (ANALYZE) jobs, webhook_deliveries")
            conn.autocommit = False
            for sql in _MAKE_DUE:
                conn.execute(sql, {"n": DUE})
            conn.commit()
            conn.execute("ANALYZE jobs, idempotency_keys")
        yield FilledDatabase(settings=settings, tenants=ids)
    finally:
        get_engine(settings).dispose()
        _drop_database(base.replace("+psycopg", "") + "/postgres", f"{name}_plans")


def plans(settings: Settings, call: Callable[[Any], object]) -> list[dict[str, Any]]:
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


def read(plan: dict[str, Any], index: str) -> int:
    """Rows the scan of ``index`` read: those it returned plus those a filter threw away. No plan scans a whole
    table."""
    assert_no_seq_scan(plan)
    (node,) = [n for n in plan_nodes(plan) if n.get("Index Name") == index]
    assert node["Node Type"] in {"Index Scan", "Index Only Scan", "Bitmap Index Scan"}, plan_line(plan)
    return int(node["Actual Rows"] * node["Actual Loops"] + node.get("Rows Removed by Filter", 0))


def assert_no_seq_scan(plan: dict[str, Any]) -> None:
    seq = [n for n in plan_nodes(plan) if n["Node Type"] == "Seq Scan"]
    assert not seq, plan_line(plan)
