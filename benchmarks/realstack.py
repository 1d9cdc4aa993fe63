"""A whole vidq stack for the benchmarks that need one, started the way the README starts it (``vidq up``): API,
sweeper, prewarmer, a video worker, the webhook worker, on this machine's Postgres where it offers pgvector (else an
embedded PostgreSQL started here), this machine's Redis and an embedded S3. It gets a database, a broker key prefix,
ports and a state directory of its own, all removed at the end, so it runs beside anything else on the machine. Also
the open-loop submitter the stack benchmarks share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis

from tools.devstack import libpq_url, postgres_with_vector

ROOT = Path(__file__).resolve().parent.parent
# Used where it offers pgvector (vidq's schema needs it); otherwise an embedded server stands in for it.
PG = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/14"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    api: str
    key: str
    env: dict[str, str]
    prefix: str
    state_dir: Path

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.env["VIDQ_BROKER_URL"])


@contextlib.contextmanager
def real_stack(extra_env: dict[str, str] | None = None) -> Iterator[Stack]:
    # `vidq up` reuses this server (it offers pgvector); an embedded one stops only once the stack is down.
    with postgres_with_vector(PG) as server:
        yield from _real_stack(server, extra_env)


def _real_stack(server: str, extra_env: dict[str, str] | None) -> Iterator[Stack]:
    db = f"vidq_bench_{uuid.uuid4().hex[:8]}"
    prefix = f"vidq-bench-{uuid.uuid4().hex[:8]}:"
    state_dir = Path(tempfile.mkdtemp(prefix="vidq-bench-stack-"))
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VIDQ_")},
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "VIDQ_DATABASE_URL": server.rsplit("/", 1)[0] + f"/{db}",
        "VIDQ_BROKER_URL": REDIS,
        "VIDQ_BROKER_KEY_PREFIX": prefix,
        "VIDQ_API_PORT": str(port),
        "VIDQ_FLOWER_PORT": str(free_port()),
        "VIDQ_WORKER_METRICS_PORT": "0",
        "VIDQ_PREWARMER_METRICS_PORT": "0",
        **(extra_env or {}),
    }
    with psycopg.connect(libpq_url(server), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    log = (state_dir / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "up", "--state-dir", str(state_dir)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (state_dir / "stack.json").exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vidq up did not start: {(state_dir / 'up.log').read_text()[-3000:]}")
            time.sleep(0.5)
        created = subprocess.run(
            [sys.executable, "-m", "tools.cli", "create-key", "--tenant", "bench"],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        key = json.loads(created.stdout)["api_key"]
        yield Stack(api=f"http://127.0.0.1:{port}", key=key, env=env, prefix=prefix, state_dir=state_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
        client = redis.Redis.from_url(REDIS)
        for k in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(k)
        with psycopg.connect(libpq_url(server), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


@dataclass
class Submitted:
    index: int
    scheduled: float  # time.time() it was due
    answered: float = 0.0
    status: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""


async def open_loop(
    stack: Stack, bodies: list[dict[str, Any]], *, rate: float, timeout_s: float = 10.0
) -> list[Submitted]:
    """Submit ``bodies`` at ``rate`` per second, each at its scheduled time whatever the answers before it (open
    loop: a slow server is charged for the queue it builds)."""
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    headers = {"Authorization": f"Bearer {stack.key}"}
    results = [Submitted(i, 0.0) for i in range(len(bodies))]
    async with httpx.AsyncClient(base_url=stack.api, headers=headers, timeout=timeout_s, limits=limits) as http:

        async def one(i: int) -> None:
            try:
                r = await http.post("/v1/jobs", json=bodies[i])
                results[i].status = r.status_code
                results[i].headers = dict(r.headers)
                with contextlib.suppress(ValueError):
                    results[i].body = r.json()
            except httpx.HTTPError as exc:
                results[i].error = type(exc).__name__
            results[i].answered = time.time()

        start = time.time() + 0.05
        tasks = []
        for i in range(len(bodies)):
            results[i].scheduled = start + i / rate
            delay = results[i].scheduled - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return results


def wait_finished(stack: Stack, ids: list[str], *, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every job's body once finished (or as it is at the deadline)."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    done: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=stack.api, headers=headers, timeout=10) as http:
        while len(done) < len(ids) and time.monotonic() < deadline:
            for job_id in ids:
                if job_id not in done:
                    job = http.get(f"/v1/jobs/{job_id}").json()
                    if job["status"] in ("succeeded", "failed", "cancelled"):
                        done[job_id] = job
            time.sleep(0.5)
        for job_id in ids:
            done.setdefault(job_id, http.get(f"/v1/jobs/{job_id}").json())
    return done


def when(text: str) -> float:
    """A job body's timestamp (ISO 8601, ``Z`` or an offset) as seconds since the epoch."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def machine() -> dict[str, str]:
    import platform

    import psutil

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": str(psutil.cpu_count()),
        "memory_gib": f"{psutil.virtual_memory().total / 2**30:.0f}",
        "python": platform.python_version(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }


def write_report(out: Path, name: str, report: dict[str, Any], markdown: str) -> None:
    """``<name>_<date>.json`` (the figures) and ``.md`` (``markdown``) under ``out``; the Markdown is printed too."""
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{name}_{datetime.now(UTC):%Y%m%d}"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    base.with_suffix(".md").write_text(markdown)
    print(markdown)
