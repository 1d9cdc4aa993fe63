"""The API's hot paths to Postgres: submit (with its result-cache lookup), read and list jobs, on psycopg's async
connection pool.

Why not the SQLAlchemy session here: measured on a 2-core machine, an INSERT + COMMIT through SQLAlchemy (sync or
async, Core or ORM) costs 2.3–2.7 ms of CPU, through psycopg directly 1.3 ms, and the thread-pool hop of a sync
route another 0.3 ms (benchmarks/results/api_load_*.md). So this module is a driver only: the statements and their
rules are the jobs repository's (shared/jobs/repository.py, on the tables of shared/models.py), compiled once at
import to SQL with psycopg placeholders; rows come back as ``Job`` objects, so presenting a job is the same code
everywhere.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import JSON, Table, bindparam, insert
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import ClauseElement

from shared.infra.config import Settings
from shared.jobs import repository
from shared.jobs.repository import RESULT_COLUMNS
from shared.jobs.status import JobStatus
from shared.models import Job

_DIALECT = postgresql.psycopg.dialect()
_JOBS: Table = Job.__table__  # type: ignore[assignment]  # declared models' tables are Tables
# Column name → attribute name ("metadata" is ``Job.metadata_``), in the table's column order.
_ATTRS = [(col.name, attr.key) for attr in Job.__mapper__.column_attrs for col in attr.columns]
JOB_COLUMNS = [col for col, _ in _ATTRS]  # what job_from_row reads, in its order
_JSON_COLUMNS = {c.name for c in _JOBS.columns if isinstance(c.type, JSON)}
# What an INSERT sends: every column Postgres does not fill itself (created_at is the database's clock).
_INSERTED = [(col, attr) for col, attr in _ATTRS if _JOBS.c[col].server_default is None]


def _sql(statement: ClauseElement) -> str:
    return str(statement.compile(dialect=_DIALECT))


_INSERT_JOB = _sql(insert(_JOBS).values({col: bindparam(col) for col, _ in _INSERTED}).returning(*_JOBS.columns))
_GET_JOB = _sql(repository.GET_JOB)
_POSITION = _sql(repository.POSITION)
_LIVE_KEY = _sql(repository.LIVE_KEY)
_CLAIM_KEY = _sql(repository.CLAIM_KEY)
_INSERT_TRANSITION = _sql(repository.INSERT_TRANSITION)
_RESULT_SOURCE = _sql(repository.RESULT_SOURCE)
_QUEUED_WORK = _sql(repository.QUEUED_WORK)
_QUEUED_COUNTS = _sql(repository.QUEUED_COUNTS)
_RUNNING_WORK = _sql(repository.RUNNING_WORK)


def result_source_query(*, tenant_id: uuid.UUID, result_key: str) -> tuple[str, dict[str, Any]]:
    """The SQL and parameters of the submit's result-cache lookup (query-plan tests EXPLAIN these)."""
    return _RESULT_SOURCE, {"tenant_id": tenant_id, "result_key": result_key}


@dataclass(frozen=True, slots=True)
class ResultSource:
    """A stored result a new job may reuse: the job that rendered it, its output columns, and the clock."""

    job_id: uuid.UUID
    output: dict[str, Any]  # RESULT_COLUMNS → values
    now: datetime


_LIST = {
    (s, after, ascending): _sql(repository.page(status=s, after=after, ascending=ascending))
    for s in [None, *JobStatus]
    for after in (False, True)
    for ascending in (False, True)
}


def list_query(
    *,
    tenant_id: uuid.UUID,
    status: JobStatus | None,
    limit: int,
    after: tuple[datetime, uuid.UUID] | None,
    ascending: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The SQL and parameters of one list page, as ``JobStore.page`` sends them (query-plan tests EXPLAIN these)."""
    params: dict[str, Any] = {"tenant_id": tenant_id, "limit": limit}
    if after is not None:
        params["ts"], params["jid"] = after
    return _LIST[(status, after is not None, ascending)], params


def job_from_row(row: TupleRow) -> Job:
    job = Job()
    for (_, attr), value in zip(_ATTRS, row, strict=True):
        setattr(job, attr, value)
    return job


def _params(values: dict[str, Any]) -> dict[str, Any]:
    """Attribute-keyed values → column-keyed parameters, JSON wrapped for psycopg."""
    out: dict[str, Any] = {}
    for column, attr in _INSERTED:
        if attr in values:
            value = values[attr]
            out[column] = Jsonb(value) if column in _JSON_COLUMNS and value is not None else value
        else:
            out[column] = _default(column)
    return out


def _default(column: str) -> Any:
    """The model's Python-side default (SQLAlchemy wraps a callable one to take an execution context)."""
    arg = getattr(_JOBS.c[column].default, "arg", None)
    if callable(arg):
        arg = arg(None)
    return Jsonb(arg) if column in _JSON_COLUMNS and arg is not None else arg


class JobStore:
    """One async pool per API process (built in the lifespan). Every call is one statement, on a connection from
    ``connection()`` (the statement is its own transaction) or in a ``transaction()`` with others."""

    def __init__(self, settings: Settings) -> None:
        conninfo = settings.sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)
        self.pool = AsyncConnectionPool(
            conninfo,
            min_size=1,
            max_size=settings.db_pool_size,
            timeout=settings.db_pool_timeout_s,
            max_lifetime=settings.db_pool_recycle_s,
            # After an outage the pool reconnects with a doubling delay (1, 2, 4, 8 … s) that psycopg does not cap:
            # Postgres back after 10 s would wait for the attempt at 15 s, after 60 s for the one at 63 s. Giving
            # up after this long ends the wait; the next request then connects at once (and backs off again).
            reconnect_timeout=settings.db_pool_reconnect_s,
            open=False,
            kwargs={
                # A single statement is its own transaction (one round trip); several share one through
                # ``transaction()`` (BEGIN … COMMIT).
                "autocommit": True,
                "connect_timeout": settings.db_connect_timeout_s,
                "options": f"-c statement_timeout={settings.db_statement_timeout_ms}",
            },
        )

    async def open(self) -> None:
        await self.pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection[TupleRow]]:
        """A connection in a transaction, committed at the end of the block (rolled back on an exception)."""
        async with self.pool.connection() as conn, conn.transaction():
            yield conn

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection[TupleRow]]:
        """A connection for one statement, committed as it runs (no BEGIN or COMMIT round trips)."""
        async with self.pool.connection() as conn:
            yield conn

    async def get(self, conn: AsyncConnection[TupleRow], *, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job | None:
        cur = await conn.execute(_GET_JOB, {"id": job_id, "tenant_id": tenant_id})
        row = await cur.fetchone()
        return None if row is None else job_from_row(row)

    async def insert(self, conn: AsyncConnection[TupleRow], values: dict[str, Any]) -> Job:
        cur = await conn.execute(_INSERT_JOB, _params(values))
        row = await cur.fetchone()
        assert row is not None  # INSERT … RETURNING always returns the row
        return job_from_row(row)

    async def result_source(
        self, conn: AsyncConnection[TupleRow], *, tenant_id: uuid.UUID, result_key: str
    ) -> ResultSource | None:
        sql, params = result_source_query(tenant_id=tenant_id, result_key=result_key)
        cur = await conn.execute(sql, params)
        row = await cur.fetchone()
        if row is None:
            return None
        job_id, *output, now = row
        return ResultSource(job_id=job_id, output=dict(zip(RESULT_COLUMNS, output, strict=True)), now=now)

    async def record_transition(self, conn: AsyncConnection[TupleRow], row: dict[str, Any]) -> None:
        """One ``job_transitions`` row (shared/jobs/states.py ``audit``)."""
        await conn.execute(_INSERT_TRANSITION, row)

    async def live_key(
        self, conn: AsyncConnection[TupleRow], *, tenant_id: uuid.UUID, key: str
    ) -> tuple[str, uuid.UUID] | None:
        cur = await conn.execute(_LIVE_KEY, {"tenant_id": tenant_id, "key": key})
        row = await cur.fetchone()
        return None if row is None else (row[0], row[1])

    async def claim_key(
        self,
        conn: AsyncConnection[TupleRow],
        *,
        tenant_id: uuid.UUID,
        key: str,
        request_hash: str,
        job_id: uuid.UUID,
        expires_at: datetime,
    ) -> bool:
        params = {
            "tenant_id": tenant_id,
            "key": key,
            "request_hash": request_hash,
            "job_id": job_id,
            "expires_at": expires_at,
            "created_at": datetime.now(expires_at.tzinfo),
        }
        cur = await conn.execute(_CLAIM_KEY, params)
        return await cur.fetchone() is not None

    async def page(
        self,
        conn: AsyncConnection[TupleRow],
        *,
        tenant_id: uuid.UUID,
        status: JobStatus | None,
        limit: int,
        after: tuple[datetime, uuid.UUID] | None,
        ascending: bool = False,
    ) -> list[Job]:
        sql, params = list_query(tenant_id=tenant_id, status=status, limit=limit, after=after, ascending=ascending)
        cur = await conn.execute(sql, params)
        return [job_from_row(row) for row in await cur.fetchall()]

    async def position(
        self, conn: AsyncConnection[TupleRow], *, tenant_id: uuid.UUID, job_id: uuid.UUID
    ) -> tuple[datetime, uuid.UUID] | None:
        """The job's place in the list order (created_at, id), deleted or not; None for another tenant's id."""
        cur = await conn.execute(_POSITION, {"id": job_id, "tenant_id": tenant_id})
        row = await cur.fetchone()
        return None if row is None else (row[0], row[1])

    async def queued_work(self, conn: AsyncConnection[TupleRow], *, limit: int) -> list[TupleRow]:
        """(priority_class, tenant_id, tenant name, created_at, model, frames, height, width, steps) of the oldest
        ``limit`` queued jobs, oldest first."""
        cur = await conn.execute(_QUEUED_WORK, {"status": JobStatus.QUEUED.value, "limit": limit})
        return await cur.fetchall()

    async def queued_counts(self, conn: AsyncConnection[TupleRow]) -> dict[str, int]:
        """Queued jobs per class."""
        cur = await conn.execute(_QUEUED_COUNTS, {"status": JobStatus.QUEUED.value})
        return {str(klass): int(n) for klass, n in await cur.fetchall()}

    async def running_work(self, conn: AsyncConnection[TupleRow]) -> list[TupleRow]:
        """(progress_step, model, frames, height, width, steps) of every running job."""
        cur = await conn.execute(_RUNNING_WORK, {"status": JobStatus.RUNNING.value})
        return await cur.fetchall()
