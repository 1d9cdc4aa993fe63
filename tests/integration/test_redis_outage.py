"""A real outage of the broker's Redis under a real stack: a client submits jobs steadily while the Redis the
API, the sweeper and the worker share is stopped for OUTAGE_S, then started again on the same port and data. The
API keeps accepting jobs (a submit needs Postgres, not the broker); the sends it could not make are left unsent on
record, and the sweeper sends them once Redis answers. Messages already queued survive the restart, and a job
rendering when the broker goes keeps running and finishes during the outage. Every accepted job succeeds, exactly
once, and nothing the API refused was written.

The lost-message timer (``queued_resend_s``) and aging are set to a day here, so the only way back for a job whose
send failed is the sweeper's unsent rule (``enqueue_grace_s``): a job that needed the 30-minute resend would miss
the deadline. The machine's Redis is shared and must never be stopped, so the broker is a private redis-server
(tools/devstack/embedded.py) with its own API, sweeper and worker processes; Postgres and S3 are the session's.

The second test takes both down: a worker that met Postgres down at its claim hands its message back while the
broker is down too. It keeps the message until Redis takes the copy (services/worker/handback.py), so the job
succeeds once both are back, again with the lost-message resend out of reach. That one runs a private PostgreSQL
(as tests/integration/test_postgres_outage.py does) as well as the private Redis."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from shared.infra.config import Settings
from shared.infra.db import get_engine, session_scope
from shared.infra.migrate import upgrade
from shared.models import Job, JobTransition
from shared.tenants import issue_key
from tests.integration.conftest import Hold
from tests.integration.helpers import TINY, free_port
from tools.devstack.embedded import EmbeddedPostgres, EmbeddedRedis
from tools.processes import ProcessGroup, log_tail, vidq_argv, wait_for_log, wait_http, wait_until

OUTAGE_S = 8.0
SUBMIT_EVERY_S = 0.25
# TINY made cheaper still (one frame, one step): the CPU here is shared, and what is checked is that every job
# is sent, not the render.
JOB = {**TINY, "width": 32, "height": 32, "duration_s": 0.25, "fps": 4, "steps": 1}
DEADLINE_S = 240.0  # generous, for a loaded machine; far below the day that a lost message would wait
SEND_FAILED = "send failed; the sweeper will resend"


@pytest.fixture
def private_broker(
    stack_env: dict[str, str], procs: ProcessGroup, tmp_path: Path, clean_state: None
) -> Iterator[tuple[EmbeddedRedis, ProcessGroup]]:
    # Not under tmp_path: a pytest session starting meanwhile resets pytest's temp root to 0700 (see
    # test_postgres_outage.py); redis-server needs its data directory to outlive a restart.
    root = Path(tempfile.mkdtemp(prefix="vidq-outage-redis-"))
    broker = EmbeddedRedis(root / "data", port=free_port())
    try:
        broker.start()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    env = {
        **os.environ,
        **stack_env,
        "PYTHONUNBUFFERED": "1",
        "VIDQ_BROKER_URL": broker.url,
        "VIDQ_SWEEP_INTERVAL_S": "1",
        "VIDQ_ENQUEUE_GRACE_S": "0.5",
        "VIDQ_QUEUED_RESEND_S": "86400",
        "VIDQ_AGING_PROMOTE_AFTER_S": "86400",
        "VIDQ_REDIS_SOCKET_TIMEOUT_S": "2",
    }
    group = ProcessGroup(env=env, log_dir=tmp_path / "logs", spawn=procs.spawn)
    try:
        yield broker, group
    finally:
        group.stop_all(timeout_s=10)
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


def _jobs_of(settings: Settings, tenant_id: str) -> dict[str, str]:
    with session_scope(settings) as session:
        rows = session.execute(select(Job.id, Job.status).where(Job.tenant_id == uuid.UUID(tenant_id)))
        return {str(job_id): status for job_id, status in rows}


def test_a_broker_outage_while_clients_submit_strands_no_job(
    private_broker: tuple[EmbeddedRedis, ProcessGroup], settings: Settings, tenant_key: dict[str, str], hold: Hold
) -> None:
    broker, group = private_broker
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    group.env["VIDQ_PUBLIC_BASE_URL"] = url
    group.start("api", vidq_argv("api", "--no-migrate", "--port", str(port)))
    group.start("sweeper", vidq_argv("sweep", "--forever"))
    group.start("worker", vidq_argv("worker", "--role", "video", "--name", f"redis-outage-{uuid.uuid4().hex[:6]}"))
    wait_http(f"{url}/readyz", timeout_s=60, group=group)
    wait_for_log(group, "worker", "pipeline loaded", timeout_s=120)
    api_log = group.log_path("api")

    answers: list[tuple[str, httpx.Response | Exception]] = []  # (phase, answer)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant_key['api_key']}"}, timeout=15) as c:

        def submit(phase: str, seed: int) -> None:
            try:
                answers.append((phase, c.post("/v1/jobs", json={**JOB, "seed": seed})))
            except httpx.TransportError as exc:  # kept as the answer: the assertions say what came back
                answers.append((phase, exc))

        # One job renders through the outage (held after its step until the API has met the outage), and the next
        # ones wait for it in the queue: they are in Redis when it stops.
        hold.on()
        submit("before", 0)
        held = answers[0][1]
        assert isinstance(held, httpx.Response) and held.status_code == 202, held
        held_id = held.json()["id"]
        wait_until(
            lambda: c.get(f"/v1/jobs/{held_id}").json()["progress"]["step"] >= 1,
            timeout_s=120,
            what="the held job rendering",
            watch=group,
        )
        for seed in range(1, 4):
            submit("before", seed)
            time.sleep(SUBMIT_EVERY_S)

        broker.stop()  # SIGTERM: Redis saves what it holds and exits, as a restart by its supervisor does
        down_at = time.monotonic()
        seed = 100
        # The outage lasts OUTAGE_S, and at least until the API has met it at a send (the fault proven, not assumed).
        while time.monotonic() < down_at + OUTAGE_S or SEND_FAILED not in api_log.read_text(errors="replace"):
            assert time.monotonic() < down_at + 120, f"the API never met the outage:\n{log_tail(api_log)}"
            group.check_alive()
            submit("outage", seed)
            seed += 1
            time.sleep(SUBMIT_EVERY_S)
        readyz = httpx.get(f"{url}/readyz", timeout=15)
        hold.release()  # the held job finishes while the broker is still down
        wait_until(
            lambda: _jobs_of(settings, tenant_key["tenant_id"]).get(held_id) == "succeeded",
            timeout_s=120,
            what="the held job finishing during the outage",
            watch=group,
        )
        broker.start()  # the same port and data directory

        for seed in range(200, 204):
            submit("after", seed)
            time.sleep(SUBMIT_EVERY_S)

    # Every answer was a 202 (a submit needs Postgres only) or, at worst, a 503 envelope; never a 500 or a reset.
    for phase, answer in answers:
        assert isinstance(answer, httpx.Response), (phase, answer)
        assert answer.status_code in (202, 503), (phase, answer.status_code, answer.text)
        if answer.status_code == 503:
            assert answer.json()["error"]["code"] == "unavailable", answer.text
    accepted = {a.json()["id"] for _, a in answers if isinstance(a, httpx.Response) and a.status_code == 202}
    assert any(p == "outage" and a.status_code == 202 for p, a in answers if isinstance(a, httpx.Response))
    assert readyz.status_code == 503 and readyz.json()["checks"]["redis"].startswith("error"), readyz.text

    # Every accepted job is sent and succeeds; nothing else of the tenant's was written.
    last: dict[str, str] = {}

    def all_succeeded() -> bool:
        nonlocal last
        last = _jobs_of(settings, tenant_key["tenant_id"])
        return all(last.get(i) == "succeeded" for i in accepted)

    try:
        wait_until(all_succeeded, timeout_s=DEADLINE_S, what="every accepted job succeeded", watch=group)
    except Exception as exc:
        stuck = {i: last.get(i) for i in accepted if last.get(i) != "succeeded"}
        raise AssertionError(
            f"{len(stuck)} of {len(accepted)} accepted jobs did not succeed: {stuck}\n"
            f"sweeper:\n{log_tail(group.log_path('sweeper'))}\nworker:\n{log_tail(group.log_path('worker'))}"
        ) from exc
    assert set(last) == accepted

    with session_scope(settings) as session:
        successes = dict(
            session.execute(
                select(JobTransition.job_id, func.count())
                .where(
                    JobTransition.job_id.in_([uuid.UUID(i) for i in accepted]), JobTransition.to_status == "succeeded"
                )
                .group_by(JobTransition.job_id)
            ).all()
        )
    assert {str(job_id): n for job_id, n in successes.items()} == {i: 1 for i in accepted}
    outage = sum(1 for p, _ in answers if p == "outage")
    print(f"{len(accepted)} jobs accepted ({outage} submits during the outage), all succeeded once")


@pytest.fixture
def private_postgres(
    private_broker: tuple[EmbeddedRedis, ProcessGroup],
) -> Iterator[tuple[EmbeddedPostgres, Settings]]:
    """A private PostgreSQL for the private stack (the machine's is shared and must never be stopped), migrated."""
    _, group = private_broker
    root = Path(tempfile.mkdtemp(prefix="vidq-outage-pg-"))  # not under tmp_path: see private_broker
    pg = EmbeddedPostgres(root / "data", port=free_port())
    try:
        pg.start()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    settings = Settings(database_url=pg.url, broker_url=group.env["VIDQ_BROKER_URL"])  # type: ignore[arg-type]
    group.env.update({"VIDQ_DATABASE_URL": pg.url, "VIDQ_DB_POOL_TIMEOUT_S": "1", "VIDQ_DB_CONNECT_TIMEOUT_S": "2"})
    try:
        upgrade(settings)
        yield pg, settings
    finally:
        group.stop_all(timeout_s=10)  # before the database goes: nothing of the stack outlives it
        get_engine(settings).dispose()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_an_unclaimable_message_survives_the_broker_going_down_too(
    private_broker: tuple[EmbeddedRedis, ProcessGroup], private_postgres: tuple[EmbeddedPostgres, Settings]
) -> None:
    broker, group = private_broker
    pg, settings = private_postgres
    group.env["VIDQ_WORKER_CLAIM_WAIT_S"] = "2"  # the hand-back starts within seconds of the claim meeting the outage
    with session_scope(settings) as session:
        key = issue_key(session, tenant_name="both-down").api_key
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    group.env["VIDQ_PUBLIC_BASE_URL"] = url
    group.start("api", vidq_argv("api", "--no-migrate", "--port", str(port)))
    wait_http(f"{url}/readyz", timeout_s=60, group=group)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=15) as c:
        r = c.post("/v1/jobs", json=JOB)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        wait_until(lambda: _jobs_enqueued(settings, job_id), timeout_s=60, what="the job's send on record", watch=group)

    # Postgres goes first; the worker takes the message and cannot claim. Then the broker goes too, before the
    # hand-back: its re-publish fails. The outages end only once the worker has met each (the faults proven).
    pg.stop()
    group.start("worker", vidq_argv("worker", "--role", "video", "--name", f"both-down-{uuid.uuid4().hex[:6]}"))
    worker_log = group.log_path("worker")
    wait_for_log(group, "worker", "Postgres unreachable at claim", timeout_s=120)
    broker.stop()
    wait_for_log(group, "worker", "broker unreachable; retrying the re-publish", timeout_s=60)
    pg.start()
    broker.start()

    def succeeded() -> bool:
        with session_scope(settings) as session:
            return session.execute(select(Job.status).where(Job.id == uuid.UUID(job_id))).scalar() == "succeeded"

    try:
        wait_until(succeeded, timeout_s=DEADLINE_S, what="the job succeeded", watch=group)
    except Exception as exc:
        raise AssertionError(f"the job did not succeed:\n{log_tail(worker_log, 60)}") from exc
    assert "unclaimed message re-published" in worker_log.read_text(errors="replace")
    with session_scope(settings) as session:
        successes = session.execute(
            select(func.count()).where(
                JobTransition.job_id == uuid.UUID(job_id), JobTransition.to_status == "succeeded"
            )
        ).scalar_one()
    assert successes == 1


def _jobs_enqueued(settings: Settings, job_id: str) -> bool:
    with session_scope(settings) as session:
        return session.execute(select(Job.enqueued_at).where(Job.id == uuid.UUID(job_id))).scalar() is not None
