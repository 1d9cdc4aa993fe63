"""A tenant's nearest videos (pgvector HNSW) at a million stored embeddings, against an exact scan.

What it measures: the query the service sends for "this tenant's videos nearest to this one", on the table it
stores them in (``video_contexts``, one 512-d L2-normalised embedding per finished video, an HNSW index with
m 16 / ef_construction 64, a btree on (tenant_id, space, created_at)), literally:

    SET LOCAL hnsw.ef_search = 100;      -- in one transaction with the SELECT
    SELECT job_id, 1 - (embedding <=> %(q)s::vector) AS similarity FROM video_contexts
    WHERE tenant_id = %(tenant)s AND space = %(space)s AND job_id <> %(job)s
    ORDER BY embedding <=> %(q)s::vector LIMIT %(k)s;

Data (fixed seed, synthetic): ``--rows`` embeddings in 2,000 Gaussian clusters on the sphere (each cluster's
spread mostly in a 16-d subspace of its own, cluster sizes log-normal, clusters grouped in 40 topics per space with
a common direction, so unrelated videos are 0.2 apart and a video's nearest stored ones 0.75-0.93), in two spaces
(70/30%; each space its own clusters, as two embedding models would have). One big tenant holds 80% of the rows and
spans every cluster; 200 small tenants share the rest (log-normal sizes), each in 8 clusters of each space. Loaded
with binary COPY in chunks into the table as the service creates it; then VACUUM (ANALYZE), the btree, and the HNSW
build, timed (``maintenance_work_mem`` and ``max_parallel_maintenance_workers`` set for that session).

Queries are stored videos (their own job excluded), ``--small-share`` of them from small tenants (the tenant drawn
first, then its video) and the rest from the big tenant. Open loop: query i is scheduled at t0 + i/``--rate`` on a
psycopg ``AsyncConnectionPool`` of ``--connections`` (autocommit, the transaction opened by ``conn.transaction()``,
as the API's store does) and its latency counts from then, so falling behind is charged for its queue. After a
warm-up of ``--warmup`` queries through the same pool, it reports p50/p90/p99/max latency for big- and
small-tenant queries apart; recall@k against numpy's brute force over the same tenant+space rows (a returned row
counts when its exact similarity reaches the k-th best's, less 1e-5, so ties and float rounding do not count as
misses); the rows each query returned (post-filtering an HNSW scan can leave a tenant with fewer than k); the plan
each query gets (EXPLAIN of every query as a custom plan, the generic plan, and the custom/generic counts in
``pg_prepared_statements`` of every pooled connection: psycopg prepares a statement run five times); EXPLAIN
(ANALYZE, BUFFERS) of one query of each kind. Baseline, in the same run: the same queries as exact scans
(``SET LOCAL enable_indexscan = off``), ``--exact-queries`` of each kind one at a time (slow), beside the same
queries as sent one at a time, each timed after one untimed run of it; ratio exact p50 / open-loop p50.
``--ef-sweep 40,200`` runs the same open loop again at those ef_search values (before the exact scans, whose
TOAST reads would evict the index from shared_buffers): latency, recall and rows returned for each.

Caching: the build leaves the index in shared_buffers (``--shared-buffers``, 4GB by default on the embedded
server, holds the 2.5 GiB index at 1M rows); a ``--keep`` rerun starts from a server just started, with empty
shared_buffers. The table's files are read once into the OS page cache before the warm-up (a superuser's
``pg_read_binary_file``; the pgserver build has no pg_prewarm), and the blocks each phase read from outside
shared_buffers (``pg_statio_*``) are reported, so a result can be told warm from cold.

Run it from the repository root (the embedded PostgreSQL 16 + pgvector 0.6.2 of the pgserver wheel starts in
``--data-dir``; ``--database-url`` instead uses a server that has pgvector, in a schema of its own):

    python -m benchmarks.similar_search                              # 1,000,000 rows, results in benchmarks/results/
    python -m benchmarks.similar_search --rows 100000 --tag _100k    # a few minutes
    python -m benchmarks.similar_search --keep --data-dir /tmp/ss1m  # keep the loaded, indexed table ...
    python -m benchmarks.similar_search --keep --data-dir /tmp/ss1m --rate 50 --ef-search 40  # ... and query again

A build that runs past ``--max-build-s`` is cancelled and the results report the build's progress and rate.
Results: ``benchmarks/results/similar_search_<yyyymmdd><tag>.json`` and ``.md``, with the machine, versions,
server settings and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector, register_vector_async
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from tools.devstack.embedded import EmbeddedPostgres
from tools.processes import free_ports

DIM = 512
SCHEMA = "vidq_similar_bench"
SPACES = ("kf1/wan2.1-1.3b", "kf1/wan2.1-14b")
SPACE_SHARE = 0.7  # of the rows in SPACES[0]
BIG_SHARE = 0.8  # of the rows in the big tenant
SMALL_TENANTS = 200
CLUSTERS = 2000
TOPICS = 40  # per space: clusters of one topic lie closer to each other than to the rest
RANK = 16  # a cluster's spread lies mostly in a subspace of this dimension (a low intrinsic dimension, as real ones)
SPREAD = 0.6  # length of a row's offset from its cluster's centre in that subspace (× 0.6-1.4 per cluster)
NOISE = 0.25  # length of its isotropic offset
TENANT_CLUSTERS = 8  # a small tenant's videos fall in this many clusters of each space
GENERATOR = 1  # bump when the data changes: a kept table made by another generator is loaded again
TIE = 1e-5
EPOCH = datetime(2026, 12, 1, tzinfo=UTC)
LABELS = ("static", "pan", "tilt", "zoom", "orbit", "tracking", "handheld", "dolly")

DDL = """
CREATE TABLE video_contexts (
    job_id uuid PRIMARY KEY,
    tenant_id uuid NOT NULL,
    space text NOT NULL,
    embedding vector(512) NOT NULL,
    keyframes integer NOT NULL,
    motion_label text NOT NULL,
    motion_descriptor double precision[] NOT NULL,
    motion_tokens jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""
HNSW_DDL = (
    "CREATE INDEX ix_video_contexts_embedding ON video_contexts "
    "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)"
)
BTREE_DDL = "CREATE INDEX ix_video_contexts_tenant_space ON video_contexts (tenant_id, space, created_at)"
COPY = (
    "COPY video_contexts (job_id, tenant_id, space, embedding, keyframes, motion_label, motion_descriptor, "
    "motion_tokens, created_at) FROM STDIN (FORMAT BINARY)"
)
COPY_TYPES = ["uuid", "uuid", "text", "vector", "int4", "text", "float8[]", "jsonb", "timestamptz"]
QUERY = """SELECT job_id, 1 - (embedding <=> %(q)s::vector) AS similarity
FROM video_contexts
WHERE tenant_id = %(tenant)s AND space = %(space)s AND job_id <> %(job)s
ORDER BY embedding <=> %(q)s::vector
LIMIT %(k)s"""
PREPARED = (
    QUERY.replace("%(q)s", "$1").replace("%(tenant)s", "$2").replace("%(space)s", "$3").replace("%(job)s", "$4")
).replace("%(k)s", "$5")


# --- the data ----------------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    vectors: np.ndarray  # (rows, DIM) float32, unit length: exactly what is stored (pgvector keeps float4)
    tenant: np.ndarray  # int32, 0 the big tenant, 1..SMALL_TENANTS the small ones
    space: np.ndarray  # int8, index into SPACES
    job_bytes: np.ndarray  # (rows, 16) uint8: a version-4 UUID whose last four bytes are the row's index
    tenant_ids: list[uuid.UUID]
    age_s: np.ndarray  # created_at = EPOCH - age
    keyframes: np.ndarray
    label: np.ndarray
    descriptor: np.ndarray  # (rows, 8) float64
    tokens: np.ndarray  # (rows, 3) int

    @property
    def rows(self) -> int:
        return len(self.tenant)

    def job_id(self, row: int) -> uuid.UUID:
        return uuid.UUID(bytes=self.job_bytes[row].tobytes())

    @staticmethod
    def row_of(job_id: uuid.UUID) -> int:
        return int.from_bytes(job_id.bytes[12:], "big")

    def group_key(self, rows: np.ndarray | int) -> np.ndarray:
        """One integer per (tenant, space)."""
        key: np.ndarray = np.asarray(self.tenant[rows], np.int64) * len(SPACES) + self.space[rows]
        return key


def _unit(a: np.ndarray) -> np.ndarray:
    unit: np.ndarray = a / np.linalg.norm(a, axis=-1, keepdims=True)
    return unit


def generate(rows: int, seed: int) -> Corpus:
    rng = np.random.default_rng(seed)
    if rows >= 2**32:
        raise ValueError("row indexes live in four bytes of the job id")
    small_weights = rng.lognormal(0.0, 1.0, SMALL_TENANTS)
    is_big = rng.random(rows) < BIG_SHARE
    tenant = np.where(is_big, 0, 1 + rng.choice(SMALL_TENANTS, rows, p=small_weights / small_weights.sum()))
    tenant = tenant.astype(np.int32)
    space = (rng.random(rows) >= SPACE_SHARE).astype(np.int8)
    # Clusters: each space its own, in proportion to its rows; sizes log-normal; the big tenant spans them all, a
    # small tenant lives in a few.
    per_space = [round(CLUSTERS * SPACE_SHARE), CLUSTERS - round(CLUSTERS * SPACE_SHARE)]
    first = [0, per_space[0]]
    weights = rng.lognormal(0.0, 0.5, CLUSTERS)
    cluster = np.empty(rows, np.int32)
    centres = np.empty((CLUSTERS, DIM), np.float32)
    for s, count in enumerate(per_space):
        w = weights[first[s] : first[s] + count] / weights[first[s] : first[s] + count].sum()
        common = _unit(rng.standard_normal(DIM))
        topics = _unit(rng.standard_normal((TOPICS, DIM)))
        centres[first[s] : first[s] + count] = _unit(
            0.6 * common + 0.8 * topics[rng.integers(0, TOPICS, count)] + _unit(rng.standard_normal((count, DIM)))
        )
        mine = is_big & (space == s)
        cluster[mine] = first[s] + rng.choice(count, int(mine.sum()), p=w)
        picks = rng.choice(count, size=(SMALL_TENANTS + 1, TENANT_CLUSTERS), p=w)
        theirs = ~is_big & (space == s)
        cluster[theirs] = first[s] + picks[tenant[theirs], rng.integers(0, TENANT_CLUSTERS, int(theirs.sum()))]
    vectors = np.empty((rows, DIM), np.float32)
    order = np.argsort(cluster, kind="stable")
    bounds = np.searchsorted(cluster[order], np.arange(CLUSTERS + 1))
    spread = SPREAD * rng.uniform(0.6, 1.4, CLUSTERS)
    for c in range(CLUSTERS):
        members = order[bounds[c] : bounds[c + 1]]
        basis = np.linalg.qr(rng.standard_normal((DIM, RANK)))[0].T.astype(np.float32)
        z = rng.standard_normal((len(members), RANK), dtype=np.float32)
        e = rng.standard_normal((len(members), DIM), dtype=np.float32)
        x = centres[c] + (spread[c] / np.sqrt(RANK)) * (z @ basis) + (NOISE / np.sqrt(DIM)) * e
        vectors[members] = _unit(x)
    job_bytes = rng.integers(0, 256, (rows, 16), dtype=np.uint8)
    job_bytes[:, 6] = (job_bytes[:, 6] & 0x0F) | 0x40
    job_bytes[:, 8] = (job_bytes[:, 8] & 0x3F) | 0x80
    job_bytes[:, 12:] = np.arange(rows, dtype=">u4").view(np.uint8).reshape(rows, 4)
    tenant_ids = [uuid.UUID(bytes=rng.bytes(16), version=4) for _ in range(SMALL_TENANTS + 1)]
    return Corpus(
        vectors=vectors,
        tenant=tenant,
        space=space,
        job_bytes=job_bytes,
        tenant_ids=tenant_ids,
        age_s=rng.uniform(0, 90 * 86400, rows),
        keyframes=rng.integers(4, 17, rows),
        label=rng.integers(0, len(LABELS), rows),
        descriptor=rng.random((rows, 8)),
        tokens=rng.integers(0, 64, (rows, 3)),
    )


def load(conn: psycopg.Connection[Any], corpus: Corpus, *, chunk: int) -> None:
    """Binary COPY, one statement (and transaction) per chunk of rows."""
    with conn.cursor() as cur:
        for start in range(0, corpus.rows, chunk):
            began = time.perf_counter()
            with cur.copy(COPY) as copy:
                copy.set_types(COPY_TYPES)
                for i in range(start, min(start + chunk, corpus.rows)):
                    copy.write_row(
                        (
                            corpus.job_id(i),
                            corpus.tenant_ids[corpus.tenant[i]],
                            SPACES[corpus.space[i]],
                            corpus.vectors[i],
                            int(corpus.keyframes[i]),
                            LABELS[corpus.label[i]],
                            corpus.descriptor[i].tolist(),
                            Jsonb([f"{LABELS[corpus.label[i]]}:{t}" for t in corpus.tokens[i].tolist()]),
                            EPOCH - timedelta(seconds=float(corpus.age_s[i])),
                        )
                    )
            done = min(start + chunk, corpus.rows)
            print(f"  copied {done:,} rows ({chunk / (time.perf_counter() - began):,.0f} rows/s)", flush=True)


# --- the server --------------------------------------------------------------------------------------------------


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Any]]]:
    """A libpq URL of a server with pgvector, and how it was set up."""
    if args.database_url:
        url = _libpq(args.database_url)
        try:
            yield url, {"server": "--database-url", "schema": SCHEMA}
        finally:
            if not args.keep:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        return
    data_dir: Path = args.data_dir or Path(tempfile.gettempdir()) / f"vidq-similar-search-pg-{args.rows}"
    pg = EmbeddedPostgres(data_dir, port=free_ports(1)[0])
    try:
        pg.start()
        wanted = {"shared_buffers": args.shared_buffers, "max_wal_size": "8GB"}
        with psycopg.connect(_libpq(pg.url), autocommit=True) as conn:
            changed = False
            for name, value in wanted.items():
                if not re.fullmatch(r"[0-9]+[kMG]B", value):
                    raise ValueError(f"{name}: {value!r} is not a size like 4GB")
                if _show(conn, name) != value:
                    conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
                    changed = True
        if changed:  # shared_buffers takes a restart
            pg.stop()
            pg.start()
        yield _libpq(pg.url), {"server": "embedded (pgserver)", "data_dir": str(data_dir), "altered": wanted}
    finally:
        pg.stop()
        if not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(f"SHOW {name}").fetchone()
    return str(row[0]) if row else "?"


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, autocommit=True, options=f"-c search_path={SCHEMA},public", **kwargs)
    register_vector(conn)
    return conn


# --- building ----------------------------------------------------------------------------------------------------


@dataclass
class Build:
    seconds: float | None = None
    completed: bool = False
    notices: list[str] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)


def build_hnsw(url: str, args: argparse.Namespace) -> Build:
    """CREATE INDEX … USING hnsw, timed, its progress sampled from another connection; cancelled past the limit."""
    build = Build()
    with connect(url) as conn:
        conn.add_notice_handler(lambda d: build.notices.append(d.message_primary or ""))
        conn.execute(f"SET maintenance_work_mem = '{args.maintenance_work_mem}'")
        conn.execute(f"SET max_parallel_maintenance_workers = {int(args.build_workers)}")
        pid = conn.info.backend_pid
        finished = threading.Event()
        began = time.perf_counter()

        def watch() -> None:
            with connect(url) as probe:
                while not finished.wait(args.progress_s):
                    elapsed = time.perf_counter() - began
                    row = probe.execute(
                        "SELECT phase, tuples_done, tuples_total, blocks_done, blocks_total "
                        "FROM pg_stat_progress_create_index WHERE pid = %s",
                        (pid,),
                    ).fetchone()
                    if row is not None:
                        names = ("phase", "tuples_done", "tuples_total", "blocks_done", "blocks_total")
                        sample = dict(zip(names, row, strict=True))
                        build.progress.append({"elapsed_s": round(elapsed, 1), **sample})
                        print(f"  build {elapsed:7.0f} s: {sample}", flush=True)
                    if elapsed > args.max_build_s:
                        print(f"  build past {args.max_build_s:.0f} s: cancelling it", flush=True)
                        probe.execute("SELECT pg_cancel_backend(%s)", (pid,))
                        return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            conn.execute(HNSW_DDL)
            build.completed = True
        except psycopg.errors.QueryCanceled:
            build.completed = False
        finally:
            build.seconds = time.perf_counter() - began
            finished.set()
            watcher.join()
    return build


def prepare_table(url: str, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    """The loaded, indexed table, made now or found from an earlier ``--keep`` run of the same data."""
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("CREATE EXTENSION IF NOT EXISTS vector")
        admin.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    wanted = {"generator": GENERATOR, "rows": corpus.rows, "seed": args.seed}
    with connect(url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_meta (id int PRIMARY KEY, meta jsonb NOT NULL)")
        row = conn.execute("SELECT meta FROM bench_meta WHERE id = 1").fetchone()
        meta: dict[str, Any] = row[0] if row else {}
        if {key: meta.get(key) for key in wanted} != wanted:
            print("loading", flush=True)
            conn.execute("DROP TABLE IF EXISTS video_contexts")
            conn.execute("DELETE FROM bench_meta")
            conn.execute(DDL)
            conn.execute("SET synchronous_commit = off")
            began = time.perf_counter()
            load(conn, corpus, chunk=args.chunk)
            meta = {**wanted, "load_s": time.perf_counter() - began, "chunk": args.chunk}
            began = time.perf_counter()
            conn.execute("VACUUM (ANALYZE) video_contexts")
            meta["vacuum_analyze_s"] = time.perf_counter() - began
            began = time.perf_counter()
            conn.execute(BTREE_DDL)
            meta["btree_s"] = time.perf_counter() - began
            conn.execute("INSERT INTO bench_meta VALUES (1, %s)", (Jsonb(meta),))
            print(f"loaded in {meta['load_s']:.0f} s, btree {meta['btree_s']:.1f} s", flush=True)
        if not meta.get("hnsw", {}).get("completed"):
            conn.execute("DROP INDEX IF EXISTS ix_video_contexts_embedding")
            settings = {
                "maintenance_work_mem": args.maintenance_work_mem,
                "max_parallel_maintenance_workers": args.build_workers,
            }
            print(f"building HNSW ({settings})", flush=True)
            build = build_hnsw(url, args)
            meta["hnsw"] = {
                "seconds": build.seconds,
                "completed": build.completed,
                "notices": build.notices,
                "progress": build.progress,
                "settings": settings,
                "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            }
            if build.completed:
                conn.execute("ANALYZE video_contexts")
            conn.execute("UPDATE bench_meta SET meta = %s WHERE id = 1", (Jsonb(meta),))
            print(f"HNSW build {'done' if build.completed else 'cancelled'} after {build.seconds:.0f} s", flush=True)
        else:
            meta["hnsw"]["reused"] = True
    return meta


# --- querying ----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    latency_s: float  # from the scheduled start (open loop) or the send (one at a time) to the COMMIT's answer
    rows: list[int]  # row indexes of the returned job ids, in order
    similarity: list[float]
    lag_s: float = 0.0  # from the scheduled start to the query's task starting (event loop and CPU contention)


def params(corpus: Corpus, row: int, k: int) -> dict[str, Any]:
    return {
        "q": corpus.vectors[row],
        "tenant": corpus.tenant_ids[corpus.tenant[row]],
        "space": SPACES[corpus.space[row]],
        "job": corpus.job_id(row),
        "k": k,
    }


def pick_queries(corpus: Corpus, *, count: int, small_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Query rows (shuffled) and whether each is a small tenant's."""
    rng = np.random.default_rng(seed + 1)
    small = round(count * small_share)
    big_rows = rng.choice(np.nonzero(corpus.tenant == 0)[0], count - small, replace=False)
    by_tenant = np.argsort(corpus.tenant, kind="stable")
    bounds = np.searchsorted(corpus.tenant[by_tenant], np.arange(SMALL_TENANTS + 2))
    tenants = rng.choice([t for t in range(1, SMALL_TENANTS + 1) if bounds[t + 1] > bounds[t]], small)
    small_rows = np.array(
        [by_tenant[bounds[t] + rng.integers(0, bounds[t + 1] - bounds[t])] for t in tenants], dtype=np.int64
    )
    rows = np.concatenate([big_rows, small_rows])
    is_small = np.concatenate([np.zeros(len(big_rows), bool), np.ones(len(small_rows), bool)])
    order = rng.permutation(len(rows))
    return rows[order], is_small[order]


async def open_loop(
    url: str, corpus: Corpus, rows: np.ndarray, warm: np.ndarray, args: argparse.Namespace
) -> tuple[list[Outcome], float, list[dict[str, Any]]]:
    """The outcomes of the queries at ``--rate`` (after the warm-up queries, others than those measured), the
    seconds it took, and the pooled connections' prepared statements."""
    pool = AsyncConnectionPool(
        url,
        min_size=args.connections,
        max_size=args.connections,
        open=False,
        configure=register_vector_async,
        kwargs={"autocommit": True, "options": f"-c search_path={SCHEMA},public"},
    )
    await pool.open(wait=True)
    set_ef = f"SET LOCAL hnsw.ef_search = {int(args.ef_search)}"

    async def query(row: int) -> list[tuple[Any, ...]]:
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(set_ef)
            cur = await conn.execute(QUERY, params(corpus, row, args.k))
            return await cur.fetchall()

    try:
        for start in range(0, len(warm), args.connections):
            await asyncio.gather(*(query(int(r)) for r in warm[start : start + args.connections]))
        outcomes: list[Outcome | None] = [None] * len(rows)

        async def one(i: int, scheduled: float) -> None:
            started = time.perf_counter()
            result = await query(int(rows[i]))
            latency = time.perf_counter() - scheduled
            outcomes[i] = Outcome(
                latency, [Corpus.row_of(r[0]) for r in result], [float(r[1]) for r in result], started - scheduled
            )

        t0 = time.perf_counter() + 0.1
        tasks = []
        for i in range(len(rows)):
            scheduled = t0 + i / args.rate
            # The event loop's timers fire up to a millisecond late (epoll's resolution): sleep to 2 ms before,
            # then yield to the loop until the time comes.
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter() - 0.002))
            while time.perf_counter() < scheduled:
                await asyncio.sleep(0)
            tasks.append(asyncio.create_task(one(i, scheduled)))
        await asyncio.gather(*tasks)
        took = time.perf_counter() - t0
        prepared: list[dict[str, Any]] = []
        async with AsyncExitStack() as stack:  # every pooled connection at once
            conns = [await stack.enter_async_context(pool.connection()) for _ in range(args.connections)]
            for conn in conns:
                if conn.info.server_version >= 150000:  # the open loop's block reads, counted by statio()
                    await conn.execute("SELECT pg_stat_force_next_flush()")
                cur = await conn.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
                for statement, generic, custom in await cur.fetchall():
                    kind = "select" if "ORDER BY embedding" in statement else statement.strip()[:40]
                    prepared.append({"statement": kind, "generic_plans": generic, "custom_plans": custom})
    finally:
        await pool.close()
    return [o for o in outcomes if o is not None], took, prepared


def closed_loop(
    conn: psycopg.Connection[Any], corpus: Corpus, rows: Sequence[int], args: argparse.Namespace, *, exact: bool
) -> list[Outcome]:
    """One query at a time on a connection that never prepares (custom plans only), each run once untimed first
    (the query's pages in the server's cache, as the open loop's steady state has them)."""
    out = []
    for row in rows:
        with conn.transaction():
            conn.execute(f"SET LOCAL hnsw.ef_search = {int(args.ef_search)}")
            if exact:
                conn.execute("SET LOCAL enable_indexscan = off")
            conn.execute(QUERY, params(corpus, row, args.k)).fetchall()
        began = time.perf_counter()
        with conn.transaction():
            conn.execute(f"SET LOCAL hnsw.ef_search = {int(args.ef_search)}")
            if exact:
                conn.execute("SET LOCAL enable_indexscan = off")
            result = conn.execute(QUERY, params(corpus, row, args.k)).fetchall()
        out.append(
            Outcome(time.perf_counter() - began, [Corpus.row_of(r[0]) for r in result], [float(r[1]) for r in result])
        )
    return out


def explain(
    conn: psycopg.Connection[Any],
    corpus: Corpus,
    row: int,
    args: argparse.Namespace,
    *,
    exact: bool = False,
    analyze: bool = False,
) -> dict[str, Any]:
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    with conn.transaction():
        conn.execute(f"SET LOCAL hnsw.ef_search = {int(args.ef_search)}")
        if exact:
            conn.execute("SET LOCAL enable_indexscan = off")
        plan = conn.execute(f"EXPLAIN ({options}) {QUERY}", params(corpus, row, args.k)).fetchone()
    assert plan is not None
    return dict(plan[0][0])


def generic_plan(conn: psycopg.Connection[Any], corpus: Corpus, row: int, args: argparse.Namespace) -> dict[str, Any]:
    """The plan a prepared statement gets once PostgreSQL switches it to a generic plan (no parameter values)."""
    p = params(corpus, row, args.k)
    with conn.transaction():
        conn.execute(f"SET LOCAL hnsw.ef_search = {int(args.ef_search)}")
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE bench_similar (vector, uuid, text, uuid, bigint) AS {PREPARED}")
        # EXPLAIN EXECUTE cannot take bound parameters (their types are not inferred): values go in as literals.
        with psycopg.ClientCursor(conn) as cur:
            plan = cur.execute(
                "EXPLAIN (FORMAT JSON) EXECUTE bench_similar (%s::vector, %s::uuid, %s::text, %s::uuid, %s::bigint)",
                (p["q"], p["tenant"], p["space"], p["job"], p["k"]),
            ).fetchone()
        conn.execute("DEALLOCATE bench_similar")
    assert plan is not None
    return dict(plan[0][0])


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes, stack = [], [plan["Plan"]]
    while stack:
        node = stack.pop(0)
        nodes.append(node)
        stack.extend(node.get("Plans", []))
    return nodes


def plan_shape(plan: dict[str, Any]) -> str:
    """``Limit > Index Scan (ix_video_contexts_embedding)``: the nodes top-down, with the index each scan uses."""
    parts = []
    for node in _nodes(plan):
        name = node["Node Type"]
        if index := node.get("Index Name"):
            name += f" ({index})"
        parts.append(name)
    return " > ".join(parts)


def plan_detail(plan: dict[str, Any]) -> str:
    """The scans of an EXPLAIN ANALYZE: rows returned, rows a filter threw away, buffers; and its time."""
    scans = []
    for n in _nodes(plan):
        if "Scan" not in n["Node Type"]:
            continue
        rows = n.get("Actual Rows", 0) * n.get("Actual Loops", 1)
        scans.append(
            f"{n['Node Type']} {n.get('Index Name') or n.get('Relation Name', '')} (rows {rows}, "
            f"filtered out {n.get('Rows Removed by Filter', 0)}, buffers hit {n.get('Shared Hit Blocks', 0)} "
            f"read {n.get('Shared Read Blocks', 0)})"
        )
    return "; ".join(scans) + f"; {plan.get('Execution Time', 0):.2f} ms"


# --- exact neighbours and recall --------------------------------------------------------------------------------


def exact_neighbours(corpus: Corpus, rows: np.ndarray, k: int) -> tuple[list[np.ndarray], np.ndarray]:
    """For each query row, the similarities of its k nearest rows of its tenant and space (itself excluded), by
    brute force; and how many such rows there are."""
    keys = corpus.group_key(np.arange(corpus.rows))
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    query_keys = corpus.group_key(rows)
    best: list[np.ndarray] = [np.empty(0, np.float32)] * len(rows)
    available = np.zeros(len(rows), np.int64)
    for key in np.unique(query_keys):
        which = np.nonzero(query_keys == key)[0]
        members = order[np.searchsorted(sorted_keys, key) : np.searchsorted(sorted_keys, key, side="right")]
        queries = corpus.vectors[rows[which]]
        top = np.full((len(which), 0), -np.inf, np.float32)
        for start in range(0, len(members), 65536):
            block = members[start : start + 65536]
            sims = queries @ corpus.vectors[block].T
            sims[block[None, :] == rows[which][:, None]] = -np.inf
            both = np.concatenate([top, sims], axis=1)
            keep = min(k, both.shape[1])
            top = -np.sort(-np.partition(both, both.shape[1] - keep, axis=1)[:, -keep:], axis=1)
        for j, i in enumerate(which):
            best[i] = top[j][np.isfinite(top[j])]
        available[which] = len(members) - 1
    return best, available


@dataclass
class Recall:
    recall: np.ndarray
    returned: np.ndarray
    expected: np.ndarray  # min(k, rows of the tenant and space other than the query's own)
    available: np.ndarray  # rows of the tenant and space other than the query's own
    invalid: int  # rows of another tenant or space, or the query's own


def recall(
    corpus: Corpus, rows: np.ndarray, outcomes: list[Outcome], k: int, exact: tuple[list[np.ndarray], np.ndarray]
) -> Recall:
    truth, available = exact
    out = np.zeros(len(rows))
    returned = np.array([len(o.rows) for o in outcomes])
    expected = np.minimum(k, available)
    invalid = 0
    for i, (row, outcome) in enumerate(zip(rows, outcomes, strict=True)):
        got = np.array(outcome.rows, dtype=np.int64)
        valid = (corpus.group_key(got) == corpus.group_key(int(row))) & (got != row) if len(got) else got.astype(bool)
        invalid += int((~valid).sum())
        if expected[i] == 0:
            out[i] = 1.0
            continue
        sims = corpus.vectors[got[valid]] @ corpus.vectors[row]
        out[i] = min(expected[i], int((sims >= truth[i][-1] - TIE).sum())) / expected[i]
    return Recall(out, returned, expected, available, invalid)


# --- the run -----------------------------------------------------------------------------------------------------


def by_plan(idx: list[int], outcomes: list[Outcome], measured: Recall) -> dict[str, Any]:
    """The queries (custom) planned one way: latency, recall, rows returned."""
    return {
        "n": len(idx),
        "latency_ms": percentiles([outcomes[i].latency_s for i in idx]),
        "recall_mean": float(measured.recall[idx].mean()),
        "rows_returned_mean": float(measured.returned[idx].mean()),
        "short": int((measured.returned[idx] < measured.expected[idx]).sum()),
        "none": int((measured.returned[idx] == 0).sum()),
        "tenant_space_rows_median": float(np.median(measured.available[idx])),
    }


def missed(idx: list[int], outcomes: list[Outcome], measured: Recall, truth: list[np.ndarray]) -> dict[str, Any]:
    """Queries whose result held none of the k nearest although rows came back: the search never reached the
    query's own neighbourhood (its own stored vector, at distance 0, is in the index)."""
    gone = [i for i in idx if measured.recall[i] == 0 and measured.returned[i] > 0]
    return {
        "n": len(gone),
        "share": len(gone) / len(idx) if idx else 0.0,
        "returned_top_similarity_median": float(np.median([outcomes[i].similarity[0] for i in gone])) if gone else None,
        "exact_top_similarity_median": float(np.median([truth[i][0] for i in gone])) if gone else None,
        "recall_below_half": int((measured.recall[idx] < 0.5).sum()),
    }


def sweep_figures(
    kinds: dict[str, np.ndarray], outcomes: list[Outcome], measured: Recall, truth: list[np.ndarray]
) -> dict[str, Any]:
    return {
        kind: {
            "latency_ms": percentiles([outcomes[i].latency_s for i in idx]),
            "recall_mean": float(measured.recall[idx].mean()),
            "missed_share": missed([int(i) for i in idx], outcomes, measured, truth)["share"],
            "short": int((measured.returned[idx] < measured.expected[idx]).sum()),
            "none": int((measured.returned[idx] == 0).sum()),
        }
        for kind, idx in kinds.items()
        if len(idx)
    }


def percentiles(latencies_s: Sequence[float]) -> dict[str, float]:
    ms = np.sort(np.asarray(latencies_s) * 1000.0)
    if not len(ms):
        return {"n": 0}

    def at(q: float) -> float:
        return float(ms[max(0, min(len(ms) - 1, int(np.ceil(q * len(ms))) - 1))])

    return {"n": len(ms), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": float(ms[-1])}


def group_sizes(corpus: Corpus) -> dict[str, Any]:
    counts = np.bincount(corpus.group_key(np.arange(corpus.rows)), minlength=(SMALL_TENANTS + 1) * len(SPACES))
    small = counts[len(SPACES) :]
    small_tenant = np.bincount(corpus.tenant, minlength=SMALL_TENANTS + 1)[1:]
    return {
        "big_tenant_rows": int((corpus.tenant == 0).sum()),
        "big_tenant_rows_per_space": [int(c) for c in counts[: len(SPACES)]],
        "small_tenant_rows": {
            "min": int(small_tenant.min()),
            "median": float(np.median(small_tenant)),
            "max": int(small_tenant.max()),
        },
        "small_tenant_space_rows": {
            "min": int(small.min()),
            "median": float(np.median(small)),
            "max": int(small.max()),
        },
        "rows_per_space": [int((corpus.space == s).sum()) for s in range(len(SPACES))],
    }


def machine() -> dict[str, Any]:
    cpu = "?"
    mem_gib = 0.0
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name"))
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        kib = next(int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal"))
        mem_gib = kib / 2**20
    except (OSError, StopIteration):
        pass
    return {
        "uname": " ".join(platform.uname()).strip(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_gib, 1),
        "python": sys.version.split()[0],
    }


def versions(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    def pkg(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    row = conn.execute("SELECT version(), (SELECT extversion FROM pg_extension WHERE extname = 'vector')").fetchone()
    assert row is not None
    return {
        "postgres": row[0],
        "pgvector": row[1],
        "packages": {p: pkg(p) for p in ("psycopg", "psycopg-binary", "psycopg-pool", "pgvector", "numpy", "pgserver")},
    }


def prewarm(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Read the table's files (heap, TOAST, indexes) once, into the OS page cache, so that a run on a server just
    started (``--keep``) does not measure reads from disk. Needs a superuser (``pg_read_binary_file``)."""
    began = time.perf_counter()
    paths = [
        row[0]
        for row in conn.execute(
            "SELECT pg_relation_filepath(oid) FROM pg_class WHERE oid IN (SELECT 'video_contexts'::regclass "
            "UNION ALL SELECT reltoastrelid FROM pg_class WHERE oid = 'video_contexts'::regclass "
            "UNION ALL SELECT indexrelid FROM pg_index WHERE indrelid IN ('video_contexts'::regclass, "
            "(SELECT reltoastrelid FROM pg_class WHERE oid = 'video_contexts'::regclass)))"
        ).fetchall()
    ]
    total = 0
    try:
        for path in paths:
            for segment in range(1024):  # 1 GiB segments: PATH, PATH.1, PATH.2, …
                name = path if segment == 0 else f"{path}.{segment}"
                offset, chunk = 0, 64 << 20
                while True:
                    row = conn.execute("SELECT length(pg_read_binary_file(%s, %s, %s, true))", (name, offset, chunk))
                    got = (row.fetchone() or (None,))[0]
                    if not got:
                        break
                    total += got
                    offset += got
                if offset == 0:
                    break
    except psycopg.errors.InsufficientPrivilege:
        return {"skipped": "not a superuser"}
    return {"bytes": total, "seconds": round(time.perf_counter() - began, 1)}


def statio(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Blocks read from outside shared_buffers so far (the OS page cache or the disk), by relation kind."""
    flush_stats(conn)
    row = conn.execute(
        "SELECT heap_blks_read, toast_blks_read, tidx_blks_read, "
        "(SELECT idx_blks_read FROM pg_statio_user_indexes WHERE indexrelname = 'ix_video_contexts_embedding'), "
        "(SELECT idx_blks_read FROM pg_statio_user_indexes WHERE indexrelname = 'ix_video_contexts_tenant_space') "
        "FROM pg_statio_user_tables WHERE relid = 'video_contexts'::regclass"
    ).fetchone()
    names = ("heap", "toast", "toast_index", "hnsw", "btree")
    return {name: int(x or 0) for name, x in zip(names, row or (0,) * 5, strict=True)}


def flush_stats(conn: psycopg.Connection[Any]) -> None:
    """Have this backend publish its counters as soon as it goes idle (PostgreSQL 15+ holds them up to 10 s)."""
    if conn.info.server_version >= 150000:
        conn.execute("SELECT pg_stat_force_next_flush()")


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after}


def sizes(conn: psycopg.Connection[Any]) -> dict[str, int]:
    row = conn.execute(
        "SELECT pg_relation_size(c.oid), pg_relation_size(c.reltoastrelid), "
        "pg_relation_size('ix_video_contexts_embedding'), pg_relation_size('ix_video_contexts_tenant_space'), "
        "pg_relation_size('video_contexts_pkey'), pg_total_relation_size(c.oid) "
        "FROM pg_class c WHERE c.oid = 'video_contexts'::regclass"
    ).fetchone()
    assert row is not None
    names = ("heap", "toast", "hnsw", "btree_tenant_space", "pkey", "total")
    return dict(zip(names, (int(x) for x in row), strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=1200, help="open-loop queries (after the warm-up)")
    parser.add_argument("--rate", type=float, default=20.0, help="queries/s, open loop")
    parser.add_argument("--ef-search", type=int, default=100)
    parser.add_argument(
        "--ef-sweep",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[],
        help="the same open loop again at each of these ef_search values (comma-separated), before the exact scans",
    )
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--small-share", type=float, default=0.25, help="of the queries from small tenants")
    parser.add_argument("--connections", type=int, default=8, help="pool size")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--exact-queries", type=int, default=5, help="exact scans of each kind (big, small)")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--chunk", type=int, default=50_000, help="rows per COPY")
    parser.add_argument("--maintenance-work-mem", default="6GB", help="for the HNSW build's session")
    parser.add_argument("--build-workers", type=int, default=1, help="max_parallel_maintenance_workers for the build")
    parser.add_argument("--max-build-s", type=float, default=3000.0, help="cancel an HNSW build running longer")
    parser.add_argument("--progress-s", type=float, default=30.0, help="build progress sampled every this often")
    parser.add_argument("--shared-buffers", default="4GB", help="embedded server only (ALTER SYSTEM, restart)")
    parser.add_argument("--database-url", help="a server with pgvector, instead of the embedded one")
    parser.add_argument("--data-dir", type=Path, help="embedded server's data directory")
    parser.add_argument("--keep", action="store_true", help="keep the data (embedded: its directory) for a rerun")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="", help="suffix of the results' file names")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.similar_search", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {"benchmark": "similar_search", "command": command, "machine": machine()}
    report["started"] = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    report["loadavg_at_start"] = os.getloadavg()
    began = time.perf_counter()
    corpus = generate(args.rows, args.seed)
    report["data"] = {
        "rows": args.rows,
        "seed": args.seed,
        "generate_s": round(time.perf_counter() - began, 1),
        "clusters": CLUSTERS,
        "spaces": dict(zip(SPACES, (SPACE_SHARE, round(1 - SPACE_SHARE, 2)), strict=True)),
        **group_sizes(corpus),
    }
    print(f"generated {args.rows:,} rows in {report['data']['generate_s']} s", flush=True)
    with server(args) as (url, setup):
        report["server"] = setup
        meta = prepare_table(url, corpus, args)
        report["table"] = meta
        with connect(url, prepare_threshold=None) as conn:
            report["versions"] = versions(conn)
            report["settings"] = {
                name: _show(conn, name)
                for name in (
                    "shared_buffers",
                    "work_mem",
                    "effective_cache_size",
                    "max_parallel_workers_per_gather",
                    "random_page_cost",
                    "jit",
                    "max_wal_size",
                )
            }
            report["sizes"] = sizes(conn)
        if meta["hnsw"]["completed"]:
            measure(url, corpus, args, report)
    write(report, args)


def measure(url: str, corpus: Corpus, args: argparse.Namespace, report: dict[str, Any]) -> None:
    rows, is_small = pick_queries(corpus, count=args.queries, small_share=args.small_share, seed=args.seed)
    with connect(url) as conn:
        report["prewarm"] = prewarm(conn)
        before = statio(conn)
    print(f"open loop: {len(rows)} queries at {args.rate:g}/s", flush=True)
    report["loadavg_before_queries"] = os.getloadavg()
    warm, _ = pick_queries(corpus, count=args.warmup, small_share=args.small_share, seed=args.seed + 100)
    outcomes, took, prepared = asyncio.run(open_loop(url, corpus, rows, warm, args))
    report["open_loop"] = {"seconds": took, "achieved_rate": len(rows) / took, "connections": args.connections}
    print(f"open loop done in {took:.1f} s", flush=True)
    kinds = {"big": np.nonzero(~is_small)[0], "small": np.nonzero(is_small)[0]}
    exact_rows = {kind: rows[idx[: args.exact_queries]] for kind, idx in kinds.items()}
    reads: dict[str, dict[str, int]] = {}
    with connect(url) as conn:
        after_open = statio(conn)
    reads["warm-up and open loop"] = _delta(after_open, before)
    # The sweep runs before the exact scans: those pull the whole TOAST table through shared_buffers.
    swept: dict[int, list[Outcome]] = {}
    for ef in args.ef_sweep:
        print(f"open loop again at ef_search {ef}", flush=True)
        again = argparse.Namespace(**{**vars(args), "ef_search": ef})
        swept[ef] = asyncio.run(open_loop(url, corpus, rows, warm, again))[0]
    with connect(url, prepare_threshold=None) as conn:
        if swept:
            after_sweep = statio(conn)
            reads["ef_search sweep"] = _delta(after_sweep, after_open)
            after_open = after_sweep
        closed = {kind: closed_loop(conn, corpus, r.tolist(), args, exact=False) for kind, r in exact_rows.items()}
        after_closed = statio(conn)
        reads["one at a time (two passes)"] = _delta(after_closed, after_open)
        print("exact scans", flush=True)
        exact = {kind: closed_loop(conn, corpus, r.tolist(), args, exact=True) for kind, r in exact_rows.items()}
        reads["exact scans (two passes)"] = _delta(statio(conn), after_closed)
        report["blocks_read"] = reads
        print("plans", flush=True)
        plan_of = [plan_shape(explain(conn, corpus, int(row), args)) for row in rows]
        analysed = {
            kind: {
                "as_sent": explain(conn, corpus, int(rows[idx[0]]), args, analyze=True),
                "exact": explain(conn, corpus, int(rows[idx[0]]), args, exact=True, analyze=True),
            }
            for kind, idx in kinds.items()
            if len(idx)
        }
        generic = plan_shape(generic_plan(conn, corpus, int(rows[0]), args))
    print("recall", flush=True)
    truth, available = exact_neighbours(corpus, rows, args.k)
    measured = recall(corpus, rows, outcomes, args.k, (truth, available))
    exact_recall = {
        kind: recall(corpus, r, exact[kind], args.k, exact_neighbours(corpus, r, args.k)).recall.tolist()
        for kind, r in exact_rows.items()
    }
    report["queries"] = {}
    for kind, idx in kinds.items():
        if not len(idx):
            continue
        lat = percentiles([outcomes[i].latency_s for i in idx])
        group_rows = np.array([measured.expected[i] for i in idx])
        short = [int(i) for i in idx if measured.returned[i] < measured.expected[i]]
        top1 = [truth[i][0] for i in idx if len(truth[i])]
        topk = [truth[i][-1] for i in idx if len(truth[i]) == args.k]
        closed_p50 = statistics.median(o.latency_s for o in closed[kind]) * 1000 if closed[kind] else None
        exact_p50 = statistics.median(o.latency_s for o in exact[kind]) * 1000 if exact[kind] else None
        report["queries"][kind] = {
            "latency_ms": lat,
            "dispatch_lag_ms": percentiles([outcomes[i].lag_s for i in idx]),
            "service_ms": percentiles([outcomes[i].latency_s - outcomes[i].lag_s for i in idx]),
            "recall_at_k": {
                "mean": float(measured.recall[idx].mean()),
                "p10": float(np.quantile(measured.recall[idx], 0.1)),
                "min": float(measured.recall[idx].min()),
            },
            "rows_returned": {
                "mean": float(measured.returned[idx].mean()),
                "min": int(measured.returned[idx].min()),
                "queries_short_of_expected": len(short),
                "queries_with_none": int((measured.returned[idx] == 0).sum()),
                "expected_below_k": int((group_rows < args.k).sum()),
            },
            "exact_similarity": {
                "top1_p10_p50_p90": [float(x) for x in np.quantile(top1, [0.1, 0.5, 0.9])] if top1 else [],
                "topk_p10_p50_p90": [float(x) for x in np.quantile(topk, [0.1, 0.5, 0.9])] if topk else [],
            },
            "plans_custom": dict(Counter(plan_of[i] for i in idx)),
            "by_plan": {
                shape: by_plan([int(i) for i in idx if plan_of[i] == shape], outcomes, measured)
                for shape in sorted({plan_of[i] for i in idx})
            },
            "missed": missed([int(i) for i in idx], outcomes, measured, truth),
            "closed_loop_hnsw_ms": percentiles([o.latency_s for o in closed[kind]]),
            "exact_scan_ms": percentiles([o.latency_s for o in exact[kind]]),
            "exact_scan_recall": exact_recall[kind],
            "exact_p50_over_hnsw_p50": exact_p50 / lat["p50"] if exact_p50 is not None else None,
            "exact_p50_over_hnsw_one_at_a_time_p50": (
                exact_p50 / closed_p50 if exact_p50 is not None and closed_p50 else None
            ),
            "explain_analyze": {
                mode: {"shape": plan_shape(plan), "detail": plan_detail(plan)}
                for mode, plan in analysed.get(kind, {}).items()
            },
        }
    report["queries"]["all"] = {
        "latency_ms": percentiles([o.latency_s for o in outcomes]),
        "dispatch_lag_ms": percentiles([o.lag_s for o in outcomes]),
    }
    report["per_query"] = {
        "kind": ["small" if x else "big" for x in is_small],
        "latency_ms": [round(o.latency_s * 1000, 3) for o in outcomes],
        "dispatch_lag_ms": [round(o.lag_s * 1000, 3) for o in outcomes],
        "rows_returned": measured.returned.tolist(),
        "rows_expected": measured.expected.tolist(),
        "recall": [round(float(x), 3) for x in measured.recall],
        "plan": plan_of,
        "returned_top_similarity": [round(o.similarity[0], 4) if o.similarity else None for o in outcomes],
        "exact_top_similarity": [round(float(t[0]), 4) if len(t) else None for t in truth],
    }
    report["invalid_rows"] = measured.invalid
    report["plans"] = {"generic": generic, "prepared_statements": prepared}
    report["ef_sweep"] = {
        str(ef): sweep_figures(kinds, outs, recall(corpus, rows, outs, args.k, (truth, available)), truth)
        for ef, outs in [(args.ef_search, outcomes), *swept.items()]
    }
    report["loadavg_after_queries"] = os.getloadavg()


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"similar_search_{datetime.now(UTC):%Y%m%d}{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = markdown(report, args)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"written to {stem}.json and .md")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def markdown(r: dict[str, Any], args: argparse.Namespace) -> str:
    m, v, d, t = r["machine"], r.get("versions", {}), r["data"], r.get("table", {})
    hnsw = t.get("hnsw", {})
    packages = ", ".join(f"{p} {x}" for p, x in v.get("packages", {}).items())
    lines = [
        f"# similar_search, {r['started'][:10]}",
        "",
        f"- machine: `{m['uname']}`, {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM (shared with other "
        f"work: load average {r['loadavg_at_start'][0]:.2f} at the start)",
        f"- PostgreSQL: {v.get('postgres', '?')} ({r['server']['server']}); pgvector {v.get('pgvector', '?')}",
        f"- Python {m['python']}; {packages}",
        f"- command: `{r['command']}`",
        f"- server settings: {', '.join(f'{k} {x}' for k, x in r.get('settings', {}).items())}",
        f"- data: {d['rows']:,} rows, seed {d['seed']}, {d['clusters']:,} clusters; big tenant "
        f"{d['big_tenant_rows']:,} rows ({' / '.join(f'{x:,}' for x in d['big_tenant_rows_per_space'])} per "
        f"space); 200 small tenants of {d['small_tenant_rows']['min']:,}-{d['small_tenant_rows']['max']:,} rows "
        f"(median {d['small_tenant_rows']['median']:,.0f}; per space {d['small_tenant_space_rows']['min']:,}-"
        f"{d['small_tenant_space_rows']['max']:,}); spaces "
        + ", ".join(f"`{s}` {x:.0%}" for s, x in d["spaces"].items()),
    ]
    if "load_s" in t:
        lines.append(
            f"- load: binary COPY in chunks of {t['chunk']:,}, {t['load_s']:.0f} s ({d['rows'] / t['load_s']:,.0f} "
            f"rows/s); VACUUM (ANALYZE) {t['vacuum_analyze_s']:.1f} s; btree (tenant_id, space, created_at) "
            f"{t['btree_s']:.1f} s"
        )
    s = hnsw.get("settings", {})
    state = "done" if hnsw.get("completed") else "CANCELLED"
    reused = " (built by an earlier run, reused)" if hnsw.get("reused") else ""
    lines.append(
        f"- HNSW build (m 16, ef_construction 64): {state} in {hnsw.get('seconds', 0):.0f} s{reused} "
        f"({d['rows'] / max(hnsw.get('seconds') or 1, 1e-9):,.0f} rows/s), maintenance_work_mem "
        f"{s.get('maintenance_work_mem')}, max_parallel_maintenance_workers {s.get('max_parallel_maintenance_workers')}"
        + (f"; notices: {'; '.join(hnsw['notices'])}" if hnsw.get("notices") else "")
    )
    if "sizes" in r:
        z = r["sizes"]
        lines.append(
            f"- sizes: HNSW index {_gib(z['hnsw'])}; table {_gib(z['heap'])} heap + {_gib(z['toast'])} TOAST "
            "(the 2 KiB vector goes out of line: pgvector's type is STORAGE external); "
            f"btree {_gib(z['btree_tenant_space'])}, primary key {_gib(z['pkey'])}; all {_gib(z['total'])}"
        )
    if not hnsw.get("completed"):
        last = hnsw.get("progress", [{}])[-1] if hnsw.get("progress") else {}
        lines += ["", f"The build was cancelled; its last progress sample: {last}.", ""]
        return "\n".join(lines) + "\n"
    q = r["queries"]
    ol = r["open_loop"]
    lines += [
        "",
        f"## The query, open loop at {args.rate:g}/s, ef_search {args.ef_search}, k {args.k}",
        "",
        f"{q['all']['latency_ms']['n']} queries after {args.warmup} warm-up ones, {ol['connections']} pooled "
        f"connections, achieved {ol['achieved_rate']:.1f}/s; latency from each query's scheduled start, "
        "BEGIN to COMMIT.",
        "",
        "| queries | n | p50 ms | p90 ms | p99 ms | max ms | recall@k mean (min) | rows returned mean (min) | "
        "exact scan p50 ms | exact p50 / p50 | exact / as sent, one at a time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in ("big", "small"):
        if kind not in q:
            continue
        g = q[kind]
        lat, rc, rr = g["latency_ms"], g["recall_at_k"], g["rows_returned"]
        ratio, ratio1 = g["exact_p50_over_hnsw_p50"], g["exact_p50_over_hnsw_one_at_a_time_p50"]
        lines.append(
            f"| {kind} tenant | {lat['n']} | {lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | "
            f"{lat['max']:.2f} | {rc['mean']:.3f} ({rc['min']:.2f}) | {rr['mean']:.1f} ({rr['min']}) | "
            f"{g['exact_scan_ms'].get('p50', 0):.1f} (n {g['exact_scan_ms']['n']}) | "
            f"{'-' if ratio is None else f'{ratio:.1f}×'} | {'-' if ratio1 is None else f'{ratio1:.1f}×'} |"
        )
    a, lag = q["all"]["latency_ms"], q["all"]["dispatch_lag_ms"]
    lines.append(f"| all | {a['n']} | {a['p50']:.2f} | {a['p90']:.2f} | {a['p99']:.2f} | {a['max']:.2f} | | | | | |")
    lines += [
        "",
        f"Of that, from the scheduled start to the query's task starting (event loop, CPU shared with the server): "
        f"p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max {lag['max']:.2f} ms. The last column compares the "
        "exact scan with the query as sent, both one at a time on one connection (service time, no queue), each "
        "query timed after one untimed run of it.",
    ]
    pw = r.get("prewarm", {})
    warmed = f"{pw['bytes'] / 2**30:.2f} GiB in {pw['seconds']:.0f} s" if "bytes" in pw else pw.get("skipped", "-")
    lines += [
        "",
        f"Before the warm-up the table's files were read once into the OS page cache ({warmed}). Blocks read from "
        "outside shared_buffers (the OS page cache or the disk), by phase:",
        "",
        *(
            f"- {phase}: " + ", ".join(f"{name} {n:,}" for name, n in counts.items())
            for phase, counts in r.get("blocks_read", {}).items()
        ),
    ]
    if len(r.get("ef_sweep", {})) > 1:
        lines += [
            "",
            "## ef_search: the same queries again (open loop, same rate and pool; before the exact scans)",
            "",
            "| ef_search | big p50 ms | big p99 ms | big recall | big missed | big short / none | small p50 ms | "
            "small p99 ms | small recall | small short / none |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for ef, x in r["ef_sweep"].items():
            b, sm = x["big"], x.get("small")
            row = (
                f"| {ef} | {b['latency_ms']['p50']:.2f} | {b['latency_ms']['p99']:.2f} | {b['recall_mean']:.3f} | "
                f"{b['missed_share']:.1%} | {b['short']} / {b['none']} | "
            )
            if sm:
                row += (
                    f"{sm['latency_ms']['p50']:.2f} | {sm['latency_ms']['p99']:.2f} | {sm['recall_mean']:.3f} | "
                    f"{sm['short']} / {sm['none']} |"
                )
            lines.append(row)
    lines += ["", "## Plans", ""]
    for kind in ("big", "small"):
        if kind not in q:
            continue
        g = q[kind]
        rr = g["rows_returned"]
        plans = "; ".join(f"`{shape}` × {n}" for shape, n in g["plans_custom"].items())
        ea, sim, one, miss = g["explain_analyze"], g["exact_similarity"], g["closed_loop_hnsw_ms"], g["missed"]
        top1 = ", ".join(f"{x:.3f}" for x in sim["top1_p10_p50_p90"])
        topk = ", ".join(f"{x:.3f}" for x in sim["topk_p10_p50_p90"])
        lines += [
            f"- {kind} tenant, custom plans (EXPLAIN of every query): {plans}",
            f"  - EXPLAIN ANALYZE, as sent: `{ea['as_sent']['shape']}`: {ea['as_sent']['detail']}",
            f"  - EXPLAIN ANALYZE, exact (index scans off): `{ea['exact']['shape']}`: {ea['exact']['detail']}",
            f"  - rows: {rr['queries_short_of_expected']} queries returned fewer than min(k, the tenant's other rows "
            f"in the space), {rr['queries_with_none']} none; {rr['expected_below_k']} had fewer than k such rows",
            f"  - exact similarities: top-1 p10/p50/p90 {top1}; k-th {topk}",
            *(
                f"  - planned `{shape}`: {x['n']} queries (their tenant has a median "
                f"{x['tenant_space_rows_median']:,.0f} other rows in the space), p50 {x['latency_ms']['p50']:.2f} ms, "
                f"p99 {x['latency_ms']['p99']:.2f} ms, "
                f"recall {x['recall_mean']:.3f}, rows returned {x['rows_returned_mean']:.1f}, {x['short']} short of "
                f"min(k, rows there), {x['none']} none"
                for shape, x in g["by_plan"].items()
            ),
            f"  - neighbourhood missed (recall 0 although rows came back): {miss['n']} queries ({miss['share']:.1%}), "
            f"best similarity returned {_num(miss['returned_top_similarity_median'])} against "
            f"{_num(miss['exact_top_similarity_median'])} exact (medians); recall below 0.5: "
            f"{miss['recall_below_half']}",
            f"  - one at a time on one connection (custom plans): as sent p50 {one.get('p50', 0):.2f} ms, exact scan "
            f"p50 {g['exact_scan_ms'].get('p50', 0):.1f} ms, max {g['exact_scan_ms'].get('max', 0):.1f} ms "
            f"(exact scan's recall: {', '.join(f'{x:.2f}' for x in g['exact_scan_recall'])})",
        ]
    generic = sum(p["generic_plans"] for p in r["plans"]["prepared_statements"] if p["statement"] == "select")
    custom = sum(p["custom_plans"] for p in r["plans"]["prepared_statements"] if p["statement"] == "select")
    lines += [
        f"- prepared (psycopg prepares a statement after 5 runs on a connection): the SELECT ran {custom} times on a "
        f"custom plan and {generic} on the generic plan over the pool; generic plan: `{r['plans']['generic']}`",
        f"- rows of another tenant or space returned: {r['invalid_rows']}",
        f"- load average before / after the queries: {r['loadavg_before_queries'][0]:.2f} / "
        f"{r['loadavg_after_queries'][0]:.2f}",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
