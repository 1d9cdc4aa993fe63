"""The context reads are index-driven: on the 200,000-job database, with 20,000 of its succeeded jobs described
(clustered 512-d embeddings, as real videos cluster by subject), EXPLAIN ANALYZE of the very SQL the API sends
shows similar-video search walking the HNSW index (ix_video_contexts_embedding) rather than scanning or sorting
the tenant's vectors, and a motion-filtered page reading one page of ix_video_contexts_tenant_motion."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import psycopg
import pytest
from sqlalchemy import text

from benchmarks.db_data import explain, plan_line, plan_nodes
from services.api.context.service import SIMILAR, ef_search, motion_query
from shared.context import embedding, motion
from shared.context.repository import vector_literal
from shared.infra.db import get_engine
from tests.services.query_plans import FilledDatabase, read

DESCRIBED = 20_000
CLUSTERS = 200
PAGE = 50
SPACE = embedding.space("tiny-wan")


@pytest.fixture(scope="module")
def described(filled: FilledDatabase) -> FilledDatabase:
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((CLUSTERS, embedding.DIMENSIONS)).astype(np.float32)
    url = filled.settings.sqlalchemy_url.replace("+psycopg", "")
    with psycopg.connect(url) as conn:
        conn.execute("TRUNCATE video_contexts CASCADE")
        rows = conn.execute(
            "SELECT id, tenant_id, created_at FROM jobs WHERE status = 'succeeded' ORDER BY id LIMIT %s", (DESCRIBED,)
        ).fetchall()
        vectors = centres[rng.integers(0, CLUSTERS, len(rows))] + 0.35 * rng.standard_normal(
            (len(rows), embedding.DIMENSIONS)
        ).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        labels = rng.choice(motion.LABELS, len(rows))
        columns = "job_id, tenant_id, space, embedding, keyframes, motion_label, motion_descriptor, motion_tokens"
        with conn.cursor().copy(f"COPY video_contexts ({columns}, job_created_at) FROM STDIN") as copy:
            for (job_id, tenant_id, created_at), vector, label in zip(rows, vectors, labels, strict=True):
                copy.write_row(
                    (job_id, tenant_id, SPACE, vector_literal(vector), 3, label, [0.0] * 5, "[]", created_at)
                )
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM (ANALYZE) video_contexts")
    return filled


def _query(settings: Any, tenant: uuid.UUID) -> tuple[uuid.UUID, str]:
    with get_engine(settings).connect() as conn:
        row = conn.execute(
            text("SELECT job_id, embedding::text FROM video_contexts WHERE tenant_id = :t LIMIT 1"), {"t": tenant}
        ).one()
    return row[0], row[1]


@pytest.mark.parametrize("limit", [10, 100])
def test_similar_search_walks_the_hnsw_index_within_the_tenant(described: FilledDatabase, limit: int):
    settings, tenant = described.settings, described.tenants[0]
    job_id, vector = _query(settings, tenant)
    params = {"vector": vector, "tenant_id": tenant, "space": SPACE, "exclude": [job_id], "limit": limit}
    with get_engine(settings).connect() as conn, conn.begin() as tx:
        conn.exec_driver_sql(f"SET LOCAL hnsw.ef_search = {ef_search(limit)}")
        plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {SIMILAR}", params).scalar_one()[0]
        found = conn.exec_driver_sql(SIMILAR, params).all()
        tx.rollback()
    nodes = plan_nodes(plan)
    assert [n for n in nodes if n.get("Index Name") == "ix_video_contexts_embedding"], plan_line(plan)
    assert not [n for n in nodes if n["Node Type"] in {"Seq Scan", "Sort"}], plan_line(plan)
    # What the index yielded: a bounded walk of the graph, not the tenant's thousands of rows.
    assert read(plan, "ix_video_contexts_embedding") <= 3 * ef_search(limit), plan_line(plan)
    assert len(found) == limit
    with get_engine(settings).connect() as conn:
        owners = conn.execute(
            text("SELECT DISTINCT tenant_id FROM video_contexts WHERE job_id = ANY(:ids)"),
            {"ids": [row[0] for row in found]},
        ).scalars()
        assert set(owners) == {tenant}
    similarities = [row[-1] for row in found]
    assert similarities == sorted(similarities, reverse=True)


def test_a_motion_page_reads_one_page_of_its_index(described: FilledDatabase):
    settings, tenant = described.settings, described.tenants[0]
    sql, params = motion_query("pan_left", tenant_id=tenant, limit=PAGE + 1, after=None)
    with get_engine(settings).connect() as conn:
        plan = explain(conn, sql, params)
    assert read(plan, "ix_video_contexts_tenant_motion") == PAGE + 1, plan_line(plan)
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], plan_line(plan)
