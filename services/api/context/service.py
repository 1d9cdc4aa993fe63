"""Reads of the context tables (migrations/versions/0010) on the API's async pool: a page's contexts, a video's
nearest videos of the same tenant, and a tenant's videos of one motion. Every read is scoped to the tenant."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import TupleRow

from services.api import pagination
from services.api.store import JOB_COLUMNS, JobStore, job_from_row
from shared.context import ids
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.jobs.schemas import ContextOut, MotionOut
from shared.models import Job

_JOB = ", ".join(f"j.{column}" for column in JOB_COLUMNS)

# Each video's context with its assignment in the newest set that holds one (a set is never rewritten).
_CONTEXTS = """
SELECT c.job_id, c.space, c.keyframes, c.motion_label, a.version, a.prototype, a.variant_class, a.variant
FROM video_contexts c
LEFT JOIN LATERAL (
    SELECT m.version, m.prototype, m.variant_class, m.variant FROM motion_assignments m
    WHERE m.job_id = c.job_id ORDER BY m.version DESC LIMIT 1
) a ON true
WHERE c.job_id = ANY(%(ids)s) AND c.tenant_id = %(tenant_id)s
"""

# The video's own row: a job served from the result cache shows the video of the job named in ``result_of``.
_QUERY_VECTOR = """
SELECT c.space, c.embedding::text FROM video_contexts c WHERE c.job_id = %(job_id)s AND c.tenant_id = %(tenant_id)s
"""

# The HNSW index (ix_video_contexts_embedding) orders by cosine distance; the tenant and space are checked on the
# rows it yields, so no other tenant's video is ever returned.
SIMILAR = f"""
SELECT {_JOB}, 1 - (c.embedding <=> %(vector)s::vector) AS similarity
FROM video_contexts c
JOIN jobs j ON j.id = c.job_id
WHERE c.tenant_id = %(tenant_id)s AND c.space = %(space)s AND c.job_id <> ALL(%(exclude)s) AND j.deleted_at IS NULL
ORDER BY c.embedding <=> %(vector)s::vector
LIMIT %(limit)s
"""

# A motion label: ix_video_contexts_tenant_motion, in the list's keyset order (the job's created_at, then id).
_BY_LABEL = f"""
SELECT {_JOB} FROM video_contexts c JOIN jobs j ON j.id = c.job_id
WHERE c.tenant_id = %(tenant_id)s AND c.motion_label = %(label)s AND j.deleted_at IS NULL {{after}}
ORDER BY c.job_created_at DESC, c.job_id DESC LIMIT %(limit)s
"""
# A prototype or a variant of one set: ix_motion_assignments_prototype / _variant, then the tenant's jobs.
_BY_PROTOTYPE = f"""
SELECT {_JOB} FROM motion_assignments a JOIN jobs j ON j.id = a.job_id
WHERE a.version = %(version)s AND a.prototype = %(index)s AND j.tenant_id = %(tenant_id)s AND j.deleted_at IS NULL
{{after}} ORDER BY j.created_at DESC, j.id DESC LIMIT %(limit)s
"""
_BY_VARIANT = f"""
SELECT {_JOB} FROM motion_assignments a JOIN jobs j ON j.id = a.job_id
WHERE a.version = %(version)s AND a.variant_class = %(label)s AND a.variant = %(index)s
  AND j.tenant_id = %(tenant_id)s AND j.deleted_at IS NULL {{after}}
ORDER BY j.created_at DESC, j.id DESC LIMIT %(limit)s
"""
_AFTER_LABEL = "AND (c.job_created_at, c.job_id) < (%(ts)s, %(jid)s)"
_AFTER_JOB = "AND (j.created_at, j.id) < (%(ts)s, %(jid)s)"

SIMILAR_LIMIT_MAX = 100
# HNSW's candidate list: the tenant and space are checked on what it yields, so it looks well past ``limit``. At a
# million clustered vectors 200 finds 95% of queries' neighbourhoods for ~8 ms (benchmarks/results/similar_search_*).
EF_SEARCH_MIN = 200
EF_SEARCH_MAX = 1000  # pgvector's ceiling
# pgvector 0.8 and later walk the graph on until ``limit`` rows pass the tenant's filter (iterative index scans);
# earlier versions stop at ef_search candidates, so a small tenant's page can come back short.
_ITERATIVE_FROM = (0, 8)
_iterative: list[bool] = []  # known once per process


def ef_search(limit: int) -> int:
    return max(EF_SEARCH_MIN, min(EF_SEARCH_MAX, 10 * limit))


async def _iterative_scans(conn: AsyncConnection[TupleRow]) -> bool:
    if not _iterative:
        cur = await conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        row = await cur.fetchone()
        version = tuple(int(part) for part in str(row[0]).split(".")[:2]) if row else (0, 0)
        _iterative.append(version >= _ITERATIVE_FROM)
    return _iterative[0]


async def contexts(store: JobStore, *, tenant_id: uuid.UUID, jobs: list[Job]) -> dict[uuid.UUID, ContextOut]:
    """The contexts of the succeeded jobs among ``jobs`` (one query for a whole page); a job served from the result
    cache has its source's (the same video)."""
    shown = {job.id: job.result_of or job.id for job in jobs if job.status == "succeeded"}
    if not shown:
        return {}
    async with store.connection() as conn:
        cur = await conn.execute(_CONTEXTS, {"ids": list(set(shown.values())), "tenant_id": tenant_id})
        found = {row[0]: _context(row) for row in await cur.fetchall()}
    return {job_id: found[video] for job_id, video in shown.items() if video in found}


def _context(row: TupleRow) -> ContextOut:
    _, space, keyframes, label, version, prototype, variant_class, variant = row
    return ContextOut(
        embedding_version=space.split("/", 1)[0],
        space=space,
        keyframes=keyframes,
        motion=MotionOut(
            label=label,
            prototype=ids.prototype_id(version, prototype) if version is not None else None,
            variant=(
                ids.variant_id(version, variant_class, variant) if version is not None and variant is not None else None
            ),
        ),
    )


async def similar(
    store: JobStore, *, tenant_id: uuid.UUID, job_id: uuid.UUID, limit: int
) -> tuple[str, list[tuple[Job, float]]]:
    """The job's space and its tenant's nearest videos in it, most similar first."""
    async with store.transaction() as conn:
        job = await store.get(conn, tenant_id=tenant_id, job_id=job_id)
        if job is None:
            raise NotFound("job not found")
        video = job.result_of or job.id  # its own render, or the one it reuses
        cur = await conn.execute(_QUERY_VECTOR, {"job_id": video, "tenant_id": tenant_id})
        found = await cur.fetchone()
        if found is None:
            raise Conflict(
                "this job's video has no context yet: it is described after it succeeds (or its description failed)"
            )
        space, vector = found
        await conn.execute(f"SET LOCAL hnsw.ef_search = {ef_search(limit)}")
        if await _iterative_scans(conn):
            await conn.execute("SET LOCAL hnsw.iterative_scan = strict_order")
        cur = await conn.execute(
            SIMILAR,
            {"vector": vector, "tenant_id": tenant_id, "space": space, "exclude": [job_id, video], "limit": limit},
        )
        rows = await cur.fetchall()
    return space, [(job_from_row(row[:-1]), float(row[-1])) for row in rows]


def motion_query(
    motion: str, *, tenant_id: uuid.UUID, limit: int, after: tuple[datetime, uuid.UUID] | None
) -> tuple[str, dict[str, Any]]:
    """The SQL and parameters of one page of the tenant's jobs of ``motion`` (a label or a prototype id)."""
    try:
        parsed = ids.parse_motion_filter(motion)
    except ValueError as exc:
        raise InvalidRequest(f"motion: {exc}") from None
    params: dict[str, Any] = {"tenant_id": tenant_id, "limit": limit}
    if after is not None:
        params["ts"], params["jid"] = after
    if parsed[0] == "label":
        params["label"] = parsed[1]
        return _BY_LABEL.format(after=_AFTER_LABEL if after else ""), params
    if parsed[0] == "prototype":
        params["version"], params["index"] = parsed[1], parsed[2]
        return _BY_PROTOTYPE.format(after=_AFTER_JOB if after else ""), params
    params["version"], params["label"], params["index"] = parsed[1], parsed[2], parsed[3]
    return _BY_VARIANT.format(after=_AFTER_JOB if after else ""), params


async def list_by_motion(
    store: JobStore, *, tenant_id: uuid.UUID, motion: str, limit: int, cursor: str | None
) -> tuple[list[Job], str | None]:
    """One page of the tenant's videos of ``motion``, newest first, with the next page's cursor (the job list's)."""
    after = pagination.decode_cursor(cursor) if cursor is not None else None
    sql, params = motion_query(motion, tenant_id=tenant_id, limit=pagination.read_size(limit), after=after)
    async with store.connection() as conn:
        cur = await conn.execute(sql, params)
        rows = [job_from_row(row) for row in await cur.fetchall()]
    page, more = pagination.split(rows, limit)
    return page, pagination.encode_cursor(page[-1].created_at, page[-1].id) if more else None
