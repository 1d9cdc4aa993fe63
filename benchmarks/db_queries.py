"""The control plane's queries on a table of millions of jobs: what the API and the sweeper send, against the
pre-0002 forms, in one run.

    python -m benchmarks.db_queries [--jobs 2000000] [--seconds 10] [--rate 50] [--out benchmarks/results]

It makes a database of its own (vidq_bench_<hex>; dropped at the end) on the local Postgres where that offers
pgvector (vidq's schema needs it), else on an embedded PostgreSQL 16 (pgserver) started for the run; the report
names the server. It migrates the database, fills ``jobs`` with ``benchmarks.db_data.fill`` (a month of jobs,
nothing due for the sweeper), ANALYZEs, and measures:
  list      the SQL GET /v1/jobs sends (services/api/store.py ``list_query``), 100 a page: first page,
            status-filtered page, cursor page at depth ``--depth``; open loop at ``--rate`` req/s for
            ``--seconds`` (request i is scheduled at
            t0 + i/rate and its latency counts from then, so falling behind is charged for its queue)
  before    the same cursor page with the OR cursor this replaced; the old ``webhooks_due`` (a scan of finished
            jobs for a missing delivery row) beside today's
  sweeper   ``Sweeper.sweep_once()`` with nothing due, ``--cycles`` times in a row
  presign   200 URLs (a page of 100 succeeded jobs): signing each against the memoised ``Storage.presign``
Results: benchmarks/results/db_queries_<yyyymmdd>.md, with the machine, versions and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path

import psycopg
from pydantic import PostgresDsn, RedisDsn
from sqlalchemy import and_, create_engine, exists, func, or_, select, text
from sqlalchemy.orm import Session, sessionmaker

from benchmarks.db_data import QUEUED, RUNNING, capture_sql, explain, fill, plan_line
from services.api.pagination import decode_cursor, encode_cursor
from services.api.store import list_query
from services.sweeper.sweeper import Sweeper
from shared.infra.config import Settings
from shared.infra.db import dispose_engines
from shared.infra.migrate import upgrade
from shared.infra.storage import Storage
from shared.jobs.repository import webhooks_due
from shared.jobs.status import TERMINAL, JobStatus
from shared.messaging.celery_app import make_celery
from shared.models import Job, WebhookDelivery
from tools.devstack import libpq_url, postgres_with_vector

# Used where it offers pgvector; otherwise an embedded server stands in for it.
LOCAL_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


# --- the pre-0002 forms, kept literally as the baseline --------------------------------------------------------


def list_jobs_or_cursor(
    session: Session, *, tenant_id: uuid.UUID, limit: int, cursor: tuple[datetime, uuid.UUID]
) -> list[Job]:
    ts, jid = cursor
    stmt = (
        select(Job)
        .where(Job.tenant_id == tenant_id, or_(Job.created_at < ts, and_(Job.created_at == ts, Job.id < jid)))
        .order_by(Job.created_at.desc(), Job.id.desc())
        .limit(limit + 1)
    )
    return list(session.execute(stmt).scalars())


def webhooks_due_scan(session: Session, *, now: datetime, grace_s: float, limit: int) -> list[Job]:
    return list(
        session.execute(
            select(Job)
            .where(
                Job.status.in_([s.value for s in TERMINAL]),
                Job.webhook_url.is_not(None),
                Job.finished_at < now - timedelta(seconds=grace_s),
                Job.finished_at > now - timedelta(days=1),
                ~exists().where(WebhookDelivery.job_id == Job.id),
            )
            .limit(limit)
        ).scalars()
    )


# --- measuring ---------------------------------------------------------------------------------------------


def open_loop(call: Callable[[int], object], *, rate: float, seconds: float, workers: int = 16) -> list[float]:
    """Latencies (s) of rate × seconds calls, each measured from its scheduled start."""
    n = int(rate * seconds)
    t0 = time.perf_counter() + 0.05
    latencies = [0.0] * n

    def run(k: int) -> None:
        call(k)
        latencies[k] = time.perf_counter() - (t0 + k / rate)

    with ThreadPoolExecutor(workers) as pool:
        for k in range(n):
            time.sleep(max(0.0, t0 + k / rate - time.perf_counter()))
            pool.submit(run, k)
    return latencies


def closed_loop(call: Callable[[int], object], *, runs: int) -> list[float]:
    out = []
    for k in range(runs):
        start = time.perf_counter()
        call(k)
        out.append(time.perf_counter() - start)
    return out


def summary(latencies: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    return {"n": len(ms), "p50": statistics.median(ms), "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "max": ms[-1]}


# --- the run -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2_000_000)
    parser.add_argument("--depth", type=int, default=500_000, help="cursor depth (in the largest tenant)")
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s, open loop")
    parser.add_argument("--seconds", type=float, default=10.0, help="per open-loop scenario")
    parser.add_argument("--cycles", type=int, default=50, help="sweeps with nothing due")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    name = f"vidq_bench_{uuid.uuid4().hex[:8]}"
    with postgres_with_vector(LOCAL_SERVER) as server_url:
        server = libpq_url(server_url)
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        try:
            report = run(args, server_url.rsplit("/", 1)[0] + f"/{name}", server=server)
        finally:
            dispose_engines()
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"db_queries_{datetime.now(UTC):%Y%m%d}.md"
    path.write_text(report)
    print(report)
    print(f"written to {path}")


def run(args: argparse.Namespace, database_url: str, *, server: str) -> str:
    # Nothing may be due, so nothing is sent: a broker nobody listens on makes a send fail at once rather than
    # leave messages in a Redis that others share.
    settings = Settings(
        database_url=PostgresDsn(database_url),
        broker_url=RedisDsn("redis://127.0.0.1:1/0"),
    )
    upgrade(settings)
    began = time.perf_counter()
    with psycopg.connect(settings.sqlalchemy_url.replace("+psycopg", "")) as raw:
        raw.execute("SET synchronous_commit = off")
        tenants = fill(raw, jobs=args.jobs)
    print(f"filled {args.jobs:,} jobs in {time.perf_counter() - began:.0f} s")
    engine = create_engine(settings.sqlalchemy_url, pool_size=16, max_overflow=0)
    sessions = sessionmaker(bind=engine, expire_on_commit=False)
    big = tenants[0]
    with sessions() as session:
        deep = [  # ten cursors at the given depth and a little past it, so the runs do not all read one page
            session.execute(
                select(Job)
                .where(Job.tenant_id == big)
                .order_by(Job.created_at.desc(), Job.id.desc())
                .offset(args.depth + 997 * k)
                .limit(1)
            ).scalar_one()
            for k in range(10)
        ]
    cursors = [encode_cursor(job.created_at, job.id) for job in deep]
    statuses = [JobStatus.FAILED, JobStatus.SUCCEEDED, JobStatus.CANCELLED]

    def page(tenant: uuid.UUID, status: JobStatus | None = None, cursor: str | None = None) -> None:
        # The SQL the API's async store sends for GET /v1/jobs (services/api/store.py), here through a session.
        after = decode_cursor(cursor) if cursor else None
        sql, params = list_query(tenant_id=tenant, status=status, limit=101, after=after)
        with sessions() as session:
            session.connection().exec_driver_sql(sql, params).fetchall()

    def old_deep(k: int) -> None:
        with sessions() as session:
            list_jobs_or_cursor(session, tenant_id=big, limit=100, cursor=(deep[k % 10].created_at, deep[k % 10].id))

    scenarios: dict[str, Callable[[int], object]] = {
        "first page": lambda k: page(tenants[k % len(tenants)]),
        "status page": lambda k: page(tenants[k % len(tenants)], statuses[k % 3]),
        f"cursor at depth {args.depth:,}": lambda k: page(big, cursor=cursors[k % 10]),
        f"cursor at depth {args.depth:,}, OR form (before)": old_deep,
    }
    lines = [f"# db_queries, {datetime.now(UTC):%Y-%m-%d}", "", *machine_lines(args, server), ""]
    lines += ["## Plans (EXPLAIN ANALYZE of the SQL each function sends, warm)", ""]
    with engine.connect() as conn:
        for label, call in scenarios.items():
            for statement, params in capture_sql(engine, lambda c=call: c(0)):  # type: ignore[misc]
                lines.append(f"- {label}: {plan_line(explain(conn, statement, params))}")
    lines += ["", f"## API list queries, 100 a page, open loop {args.rate:g} req/s × {args.seconds:g} s", ""]
    lines += ["| query | service p50 ms (closed loop) | open-loop p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    results: dict[str, dict[str, float]] = {}
    for label, call in scenarios.items():
        closed = summary(closed_loop(call, runs=20))
        # The OR form cannot keep up at this rate; a shorter burst shows its queue without a minute-long wait.
        seconds = args.seconds if "before" not in label else min(args.seconds, 2.0)
        opened = summary(open_loop(call, rate=args.rate, seconds=seconds))
        results[label] = {"closed": closed["p50"], **opened}
        lines.append(
            f"| {label} | {closed['p50']:.2f} | {opened['p50']:.2f} | {opened['p99']:.2f} | {opened['max']:.2f} |"
        )
        print(lines[-1])
    after, before = (
        results[f"cursor at depth {args.depth:,}"],
        results[f"cursor at depth {args.depth:,}, OR form (before)"],
    )
    lines += [
        "",
        f"Deep cursor, before / after: service time ×{before['closed'] / after['closed']:.0f}, "
        f"open-loop p50 ×{before['p50'] / after['p50']:.0f}, p99 ×{before['p99'] / after['p99']:.0f}. The OR form "
        f"cannot sustain {args.rate:g} req/s here: its open-loop row is a {min(args.seconds, 2.0):g} s burst, and "
        "its queue (so its latency) grows with the burst's length.",
    ]
    lines += sweeper_lines(settings, sessions, cycles=args.cycles)
    lines += presign_lines(settings)
    engine.dispose()
    return "\n".join(lines) + "\n"


def sweeper_lines(settings: Settings, sessions: sessionmaker[Session], *, cycles: int) -> list[str]:
    with sessions.begin() as session:  # the backlog was sent "lately" at fill time: make that true again
        session.execute(
            text("UPDATE jobs SET enqueued_at = now() - random() * interval '60 s' WHERE status = 'queued'")
        )
    sweeper = Sweeper(settings, celery=make_celery(settings), sessions=sessions)
    first = sweeper.sweep_once()
    due = (first.requeued, first.failed, first.resent, first.promoted, first.webhooks, first.keys_expired)
    assert not any(due), f"something was due: {first}"
    lines = ["", "## Sweeper, nothing due", ""]
    engine = sessions.kw["bind"]
    with engine.connect() as conn:
        for statement, params in capture_sql(engine, sweeper.sweep_once):
            if "FROM jobs" in statement or "idempotency_keys" in statement:
                lines.append(
                    f"- `{statement.split()[0]} … {_where(statement)}`: {plan_line(explain(conn, statement, params))}"
                )
    cycle = summary(closed_loop(lambda k: sweeper.sweep_once(), runs=cycles))
    lines += [
        "",
        f"`Sweeper.sweep_once()` × {cycle['n']:.0f}: p50 {cycle['p50']:.2f} ms, p99 {cycle['p99']:.2f} ms, "
        f"max {cycle['max']:.2f} ms.",
    ]

    def due_now(find: Callable[..., list[Job]]) -> Callable[[int], object]:
        def call(k: int) -> object:
            with sessions.begin() as session:
                now = session.execute(select(func.now())).scalar_one()
                return find(session, now=now, grace_s=settings.webhook_resend_grace_s, limit=100)

        return call

    new, old = (
        summary(closed_loop(due_now(webhooks_due), runs=20)),
        summary(closed_loop(due_now(webhooks_due_scan), runs=10)),
    )
    lines += [
        "",
        "| webhooks due | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| before: finished jobs without a delivery row (scan) | {old['p50']:.2f} | {old['p99']:.2f} |",
        f"| after: ix_jobs_webhook_pending | {new['p50']:.2f} | {new['p99']:.2f} |",
        "",
        f"Webhooks due, before / after: p50 ×{old['p50'] / new['p50']:.0f}.",
    ]
    print("\n".join(lines))
    return lines


def _where(statement: str) -> str:
    where = statement.split("WHERE", 1)[-1].split("ORDER BY")[0]
    return " ".join(where.split())[:110]


def presign_lines(settings: Settings) -> list[str]:
    storage = Storage(settings)
    keys = [f"videos/tenant/{i}.mp4" for i in range(200)]
    expiry = timedelta(seconds=settings.presign_expiry_s)

    def sign_each(k: int) -> None:
        for key in keys:
            storage.public_client.presigned_get_object(storage.bucket, key, expires=expiry)

    def memoised(k: int) -> None:
        for key in keys:
            storage.presign(key, expiry_s=settings.presign_expiry_s)

    def cold(k: int) -> None:
        storage._presigned.clear()
        memoised(k)

    rows = {"before: sign each": sign_each, "after, first read in a bucket": cold, "after, later reads": memoised}
    lines = ["", "## Presigning 200 URLs (a page of 100 succeeded jobs)", "", "| | p50 ms | p99 ms |", "|---|---|---|"]
    for label, call in rows.items():
        result = summary(closed_loop(call, runs=50))
        lines.append(f"| {label} | {result['p50']:.3f} | {result['p99']:.3f} |")
    print("\n".join(lines))
    return lines


def machine_lines(args: argparse.Namespace, server: str) -> list[str]:
    with psycopg.connect(server) as conn:
        row = conn.execute("SELECT version()").fetchone()
    packages = ", ".join(f"{p} {version(p)}" for p in ("sqlalchemy", "psycopg", "alembic", "minio"))
    uname = " ".join(platform.uname()).strip()
    return [
        f"- machine: `{uname}`, nproc {os.cpu_count()} (shared with other work while it ran)",
        f"- Postgres: {row[0] if row else '?'}",
        f"- Python {sys.version.split()[0]}; {packages}",
        f"- command: `{shlex.join(['python', '-m', 'benchmarks.db_queries', *sys.argv[1:]])}`",
        f"- jobs {args.jobs:,} (tenants 50/25/15/10%; {RUNNING} running, {QUEUED} queued, the rest finished), "
        f"date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
    ]


if __name__ == "__main__":
    main()
