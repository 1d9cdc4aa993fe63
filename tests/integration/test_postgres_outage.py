"""A real Postgres outage under a real stack: 20 jobs in the queue, the database killed for 10 s as
``pg_ctl stop -m immediate`` does (SIGQUIT to the postmaster: no checkpoint, every connection cut), then started
again on the same data directory and port. Every job finishes within the outage plus 30 s, each with exactly one
successful attempt; during the outage the API answers 503 envelopes with Retry-After and /readyz names Postgres.

The machine's Postgres is shared and must never be stopped, so this test runs a private one (pgserver's
PostgreSQL 16, tools/devstack/embedded.py) with its own API, sweeper and worker processes and its own broker key
prefix; Redis and S3 are the session's."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from shared.infra.config import Settings
from shared.infra.db import get_engine, session_scope
from shared.infra.migrate import upgrade
from shared.models import Job, JobTransition
from shared.tenants import issue_key
from tests.conftest import _delete_broker_keys
from tests.integration.helpers import TINY, free_port
from tools.devstack.embedded import EmbeddedPostgres
from tools.processes import ProcessGroup, log_tail, vidq_argv, wait_http, wait_until

JOBS = 20
OUTAGE_S = 10.0
# TINY made cheaper still (one frame, one step): the CPU here is shared, and what is measured is the wait, not
# the render.
JOB = {**TINY, "width": 32, "height": 32, "duration_s": 0.25, "fps": 4, "steps": 1}
RECOVERY_S = 30.0  # the budget after the outage: "the outage plus seconds", never an aging or resend timer


@pytest.fixture
def private_stack(
    stack_env: dict[str, str], procs: ProcessGroup, tmp_path: Path
) -> Iterator[tuple[EmbeddedPostgres, Settings, Any]]:
    # Not under tmp_path: a pytest session starting meanwhile (another suite on this machine) resets pytest's
    # temp root to 0700, and the server, which runs as an unprivileged user, would lose its data directory.
    pg_root = Path(tempfile.mkdtemp(prefix="vidq-outage-pg-"))
    pg = EmbeddedPostgres(pg_root / "data", port=free_port())
    try:
        pg.start()
    except BaseException:
        shutil.rmtree(pg_root, ignore_errors=True)
        raise
    prefix = f"vidq-outage-{uuid.uuid4().hex[:8]}:"
    settings = Settings(database_url=pg.url, broker_key_prefix=prefix)  # type: ignore[arg-type]
    env = {
        **os.environ,
        **stack_env,
        "PYTHONUNBUFFERED": "1",
        "VIDQ_DATABASE_URL": pg.url,
        "VIDQ_BROKER_KEY_PREFIX": prefix,
        "VIDQ_SWEEP_INTERVAL_S": "1",
        # A request waits at most this for a pooled connection while the database is down: fast 503s.
        "VIDQ_DB_POOL_TIMEOUT_S": "1",
        "VIDQ_DB_CONNECT_TIMEOUT_S": "2",
    }
    group = ProcessGroup(env=env, log_dir=tmp_path / "logs", spawn=procs.spawn)
    try:
        upgrade(settings)
        yield pg, settings, group
    finally:
        group.stop_all(timeout_s=10)
        get_engine(settings).dispose()
        pg.stop()
        shutil.rmtree(pg_root, ignore_errors=True)
        _delete_broker_keys(str(settings.broker_url), prefix)


def _stop_immediately(pg: EmbeddedPostgres) -> None:
    """What ``pg_ctl stop -m immediate`` does: SIGQUIT to the postmaster, which kills every backend at once."""
    postmaster = psutil.Process(int((pg.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]))
    postmaster.send_signal(signal.SIGQUIT)

    def gone() -> bool:
        try:
            return bool(postmaster.status() == psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, timeout_s=10, what="postmaster exiting", interval_s=0.05)
    pg.stop()  # forget the server (nothing left to signal); start() brings it back on the same port and data


def _ask(request: Callable[[], httpx.Response]) -> httpx.Response | Exception:
    try:
        return request()
    except httpx.TransportError as exc:  # kept as the answer: the assertions say what came back
        return exc


def _statuses(settings: Settings, ids: list[str]) -> dict[str, str]:
    with session_scope(settings) as session:
        rows = session.execute(select(Job.id, Job.status).where(Job.id.in_([uuid.UUID(i) for i in ids])))
        return {str(job_id): status for job_id, status in rows}


def test_postgres_outage_delays_jobs_by_the_outage_and_strands_none(
    private_stack: tuple[EmbeddedPostgres, Settings, ProcessGroup],
) -> None:
    pg, settings, group = private_stack
    with session_scope(settings) as session:
        key = issue_key(session, tenant_name="outage").api_key
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    group.env["VIDQ_PUBLIC_BASE_URL"] = url
    group.start("api", vidq_argv("api", "--no-migrate", "--port", str(port)))
    group.start("sweeper", vidq_argv("sweep", "--forever"))
    wait_http(f"{url}/readyz", timeout_s=60, group=group)
    worker_log = group.log_path("worker")

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=15) as client:
        ids = []
        for seed in range(JOBS):
            r = client.post("/v1/jobs", json={**JOB, "seed": seed})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])

        _stop_immediately(pg)
        down_at = time.monotonic()
        # The worker starts during the outage: the jobs' messages surely reach it while Postgres is down. The outage
        # lasts OUTAGE_S, and at least until the worker has met it at a claim (the fault proven, not assumed).
        group.start("worker", vidq_argv("worker", "--role", "video", "--name", f"outage-{uuid.uuid4().hex[:6]}"))
        answers: list[tuple[str, httpx.Response | Exception]] = []
        met = False
        while time.monotonic() < down_at + OUTAGE_S - 1 or not met:
            assert time.monotonic() < down_at + 120, f"the worker never met the outage:\n{log_tail(worker_log)}"
            group.check_alive()
            met = met or "Postgres unreachable at claim" in worker_log.read_text(errors="replace")
            answers.append(("POST", _ask(lambda: client.post("/v1/jobs", json=JOB))))
            answers.append(("GET", _ask(lambda: client.get(f"/v1/jobs/{ids[-1]}"))))
            answers.append(("readyz", _ask(lambda: httpx.get(f"{url}/readyz", timeout=15))))
            time.sleep(0.3)
        time.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))
        pg.start()
        up_at = time.monotonic()

        # After it: every job succeeds within the outage plus seconds, with no timer to wait for.
        last: dict[str, str] = {}

        def all_succeeded() -> bool:
            nonlocal last
            try:
                last = _statuses(settings, ids)
            except DBAPIError:  # this process's pooled connections died with the server: the next try reconnects
                return False
            return all(last.get(i) == "succeeded" for i in ids)

        try:
            wait_until(all_succeeded, timeout_s=RECOVERY_S, what="every job succeeded", interval_s=0.25)
        except Exception as exc:
            raise AssertionError(f"not all jobs finished {RECOVERY_S:.0f} s after the outage: {last}") from exc
        recovered_s = time.monotonic() - up_at
        ready = httpx.get(f"{url}/readyz", timeout=15)
        assert ready.status_code == 200, ready.text
        assert client.get(f"/v1/jobs/{ids[-1]}").json()["status"] == "succeeded"

    with session_scope(settings) as session:
        successes = dict(
            session.execute(
                select(JobTransition.job_id, func.count())
                .where(JobTransition.job_id.in_([uuid.UUID(i) for i in ids]), JobTransition.to_status == "succeeded")
                .group_by(JobTransition.job_id)
            ).all()
        )
    assert {str(job_id): n for job_id, n in successes.items()} == {i: 1 for i in ids}

    # During the outage the API answered 503 in the error envelope with Retry-After: never a 500, a reset or a
    # hang; /readyz named Postgres as the dependency that was down.
    assert {what for what, _ in answers} == {"POST", "GET", "readyz"}
    for what, answer in answers:
        assert isinstance(answer, httpx.Response), (what, answer)
        r = answer
        assert r.status_code == 503, (what, r.status_code, r.text)
        if what == "readyz":
            checks = r.json()["checks"]
            assert checks["postgres"].startswith("error"), checks
            assert checks["redis"] == "ok" and checks["s3"] == "ok", checks
        else:
            assert r.json()["error"]["code"] == "unavailable", r.text
            assert int(r.headers["Retry-After"]) >= 1
    print(f"all {JOBS} jobs succeeded {recovered_s:.1f} s after Postgres came back ({len(answers)} outage answers)")
