"""A table of millions of jobs in seconds, and the plans of the SQL sent to it: shared by
benchmarks/db_queries.py and the query-plan tests (tests/services/{api,sweeper}/test_query_plans.py), so the tests
check plans on the data the benchmark times."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, event

# Tenants' shares of the jobs, in twentieths: one large tenant holds half (the deep cursor lives there).
TENANT_TWENTIETHS = (10, 5, 3, 2)
RUNNING = 64  # one per GPU
QUEUED = 2000  # a backlog, every job sent in the last two minutes

# One job every 1.3 s, newest first: 2M jobs span a month. The newest RUNNING are running (leases current), the next
# QUEUED queued (sent lately), the rest finished: 92% succeeded, 6% failed, 2% cancelled. One in three has a
# webhook, delivered (a webhook_deliveries row) when it finished in the last two days; a job of the last 23 h has
# an idempotency key in one case of four, none expired.
_FILL = """
WITH g AS (
  SELECT i, now() - i * interval '1.3 s' AS created,
         CASE WHEN i < %(running)s THEN 'running' WHEN i < %(running)s + %(queued)s THEN 'queued'
              WHEN i %% 50 IN (7, 19, 33) THEN 'failed' WHEN i %% 50 = 11 THEN 'cancelled' ELSE 'succeeded' END AS st,
         (ARRAY['high', 'medium', 'low'])[i %% 3 + 1] AS cls,
         (%(slots)s::uuid[])[i %% 20 + 1] AS tenant
  FROM generate_series(%(lo)s::bigint, %(hi)s::bigint - 1) AS i
)
INSERT INTO jobs (id, tenant_id, status, spec, duration_s, webhook_url, metadata, score, score_complexity,
  score_resolution, score_duration, priority_class, attempt, max_attempts, worker_id, lease_expires_at,
  cancel_requested, progress_step, progress_total, created_at, enqueued_at, started_at, finished_at, error_code,
  error_message, output_key, poster_key, output_bytes, output_sha256, output_frames, timings)
SELECT gen_random_uuid(), tenant, st,
  jsonb_build_object('model', 'wan2.1-1.3b', 'prompt', 'a small red boat on a calm lake at dawn, take ' || i,
    'negative_prompt', '', 'width', 832, 'height', 480, 'num_frames', 33, 'fps', 16, 'steps', 20,
    'guidance_scale', 5.0, 'seed', i),
  2.0, CASE WHEN i %% 3 = 0 THEN 'https://hooks.example.com/vidq' END, '{}', 0.6, 0.3, 0.9, 0.5, cls,
  CASE WHEN st = 'queued' THEN 0 ELSE 1 END, 3,
  CASE WHEN st = 'running' THEN 'gpu-' || i END,
  CASE WHEN st = 'running' THEN now() + interval '1 hour' END,
  false, CASE WHEN st = 'succeeded' THEN 20 ELSE 0 END, 20, created,
  CASE WHEN st = 'queued' THEN now() - (i %% 120) * interval '1 s' ELSE created + interval '10 ms' END,
  CASE WHEN st <> 'queued' THEN created + interval '1 s' END,
  CASE WHEN st NOT IN ('queued', 'running') THEN created + interval '30 s' END,
  CASE WHEN st = 'failed' THEN 'invalid_for_model' END, CASE WHEN st = 'failed' THEN 'rejected' END,
  CASE WHEN st = 'succeeded' THEN 'videos/' || tenant || '/' || i || '.mp4' END,
  CASE WHEN st = 'succeeded' THEN 'videos/' || tenant || '/' || i || '.jpg' END,
  CASE WHEN st = 'succeeded' THEN 2000000 END, CASE WHEN st = 'succeeded' THEN md5(i::text) || md5(i::text) END,
  CASE WHEN st = 'succeeded' THEN 33 END,
  CASE WHEN st = 'succeeded' THEN '{"encode_text": 0.07, "denoise": 7.4, "decode": 1.3}'::jsonb ELSE '{}' END
FROM g
"""
_DELIVERIES = """
INSERT INTO webhook_deliveries (job_id, tenant_id, event_type, msg_id, attempt, url, ok, status_code, duration_ms,
  response_excerpt, created_at)
SELECT id, tenant_id, 'job.' || status, 'msg_' || replace(id::text, '-', ''), 1, webhook_url, true, 200, 40, '',
  finished_at
FROM jobs WHERE webhook_url IS NOT NULL AND finished_at > now() - interval '2 days'
"""
_KEYS = """
INSERT INTO idempotency_keys (tenant_id, key, request_hash, job_id, created_at, expires_at)
SELECT tenant_id, 'key-' || id, md5(id::text), id, created_at, created_at + interval '24 hours'
FROM jobs WHERE created_at > now() - interval '23 hours' AND get_byte(uuid_send(id), 0) % 4 = 0
"""


def fill(
    conn: psycopg.Connection[Any], *, jobs: int, chunk: int = 250_000, say: Callable[[str], None] = print
) -> list[uuid.UUID]:
    """Tenants and ``jobs`` jobs as described above, vacuumed and analysed (as autovacuum would leave them; it would
    otherwise set about it while the queries are timed); returns the tenant ids, largest first."""
    tenants = [uuid.uuid4() for _ in TENANT_TWENTIETHS]
    for n, tid in enumerate(tenants):
        conn.execute(
            "INSERT INTO tenants (id, name, webhook_secret) VALUES (%s, %s, 'whsec_bench')", (tid, f"bench-{n}")
        )
    slots = [tid for tid, share in zip(tenants, TENANT_TWENTIETHS, strict=True) for _ in range(share)]
    for lo in range(0, jobs, chunk):
        params = {"running": RUNNING, "queued": QUEUED, "slots": slots}
        conn.execute(_FILL, {**params, "lo": lo, "hi": min(jobs, lo + chunk)})
        conn.commit()
        say(f"  {min(jobs, lo + chunk):,} jobs")
    conn.execute(_DELIVERIES)
    conn.execute(_KEYS)
    conn.commit()
    autocommit, conn.autocommit = conn.autocommit, True  # VACUUM runs outside a transaction
    conn.execute("VACUUM (ANALYZE) tenants, jobs, webhook_deliveries, idempotency_keys")
    conn.autocommit = autocommit
    return tenants


# --- plans ---------------------------------------------------------------------------------------------------


def capture_sql(engine: Engine, call: Callable[[], object]) -> list[tuple[str, Any]]:
    """The statements (and parameters) ``call`` sends through ``engine``, as the driver receives them."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return sent


def explain(conn: Connection, statement: str, parameters: Any) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one statement, in a transaction rolled back (a DELETE deletes nothing)."""
    with conn.begin() as tx:
        plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", parameters).scalar_one()
        tx.rollback()
    return dict(plan[0])


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes, stack = [], [plan["Plan"]]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.get("Plans", []))
    return nodes


def plan_line(plan: dict[str, Any]) -> str:
    """The scans of a plan: node, index or table, rows returned and rows removed by a filter; and its time."""
    scans = [
        f"{n['Node Type']} {n.get('Index Name') or n.get('Relation Name', '')} "
        f"(rows {n.get('Actual Rows', 0) * n.get('Actual Loops', 1)}, "
        f"filtered out {n.get('Rows Removed by Filter', 0)})"
        for n in plan_nodes(plan)
        if "Scan" in n["Node Type"]
    ]
    return "; ".join(scans) + f" — {plan['Execution Time']:.2f} ms"
