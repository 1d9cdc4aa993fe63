"""The prewarmer and the cache with real processes: a prewarmer process fills L2 for queued jobs before a worker
claims them; an encoder-free worker gives its job back while no prewarmer answers and renders it once one does;
jobs succeed with the cache's Redis gone; `vidq cache stats` reads the cluster's windows."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
from sqlalchemy import update

from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.models import Job, JobTransition
from shared.render.registry import TINY_WAN
from shared.render.text import encoder_identity, texts_of
from tests.integration.helpers import free_port, kill_after_test, process_env, submit, wait_job
from tools.processes import ProcessGroup, vidq_argv, wait_until


@pytest.fixture
def start_prewarmer(procs: ProcessGroup, tmp_path: Path) -> Iterator[Callable[[], str]]:
    started: list[str] = []

    def start() -> str:
        name = f"prewarmer-{len(started)}"
        alive = tmp_path / f"{name}-alive"
        with process_env(procs, VIDQ_PREWARMER_LIVENESS_FILE=str(alive), VIDQ_PREWARMER_METRICS_PORT="0"):
            procs.start(name, vidq_argv("prewarmer"))
        started.append(name)
        # The file appears after its first cycle: the encoder is loaded and the loop goes round.
        wait_until(alive.exists, timeout_s=120, what=name, watch=procs, log_path=procs.log_path(name))
        return name

    yield start
    for name in started:
        if name in procs.procs:
            kill_after_test(procs, name)


def key_of(text: str) -> str:
    return encoder_identity(TINY_WAN, dtype=torch.float32).key(text)


def in_l2(settings: Settings, text: str) -> bool:
    client = redis.Redis.from_url(settings.cache_l2_url)
    return bool(client.exists(f"{settings.broker_key_prefix}vidq:emb:l2:{key_of(text)}"))


def cluster_counts(settings: Settings) -> dict[str, int]:
    """Every window's counts summed (the current one included), as workers flushed them."""
    client = redis.Redis.from_url(str(settings.broker_url))
    total: dict[str, int] = {}
    for key in client.scan_iter(match=f"{settings.broker_key_prefix}vidq:cache:window:*"):
        for name, n in client.hgetall(key).items():
            total[name.decode()] = total.get(name.decode(), 0) + int(n)
    return total


def reasons(settings: Settings, job_id: str) -> list[str]:
    with session_scope(settings) as session:
        rows = session.query(JobTransition).filter_by(job_id=uuid.UUID(job_id)).order_by(JobTransition.id)
        return [r.reason for r in rows]


def test_the_prewarmer_encodes_queued_jobs_before_a_worker_claims_them(
    client, settings, start_worker, start_prewarmer, procs
):
    unique = uuid.uuid4().hex[:6]
    jobs = [submit(client, prompt=f"a {color} kite over the hill {unique}") for color in ("red", "blue", "green")]
    texts = {t for job in jobs for t in texts_of(job["prompt"], job["negative_prompt"], job["guidance_scale"])}
    assert not any(in_l2(settings, t) for t in texts)

    start_prewarmer()
    wait_until(lambda: all(in_l2(settings, t) for t in texts), timeout_s=30, what="the queued jobs' prompts in L2")

    before = cluster_counts(settings)
    start_worker("video")
    for job in jobs:
        assert wait_job(client, job["id"], {"succeeded"}, timeout_s=120)["attempt"] == 1

    def delta(name: str) -> int:
        return cluster_counts(settings).get(name, 0) - before.get(name, 0)

    lookups = 2 * len(jobs)  # a prompt and a negative prompt each (guidance > 1)
    wait_until(lambda: delta("l1:hit") + delta("l1:miss") >= lookups, timeout_s=10, what="the flushed lookups")
    # Every lookup was served by L1 (the forward prewarm pulls the next jobs' texts in) or L2: none reached L3,
    # and the worker encoded nothing.
    assert delta("l2:hit") == delta("l1:miss") > 0
    assert delta("l2:miss") == 0 and delta("l3:miss") == 0


def test_an_encoder_free_worker_gives_the_job_back_until_a_prewarmer_answers(
    client, settings, start_worker, start_prewarmer, procs
):
    with process_env(procs, VIDQ_WORKER_TEXT_ENCODER="remote", VIDQ_WORKER_REMOTE_ENCODE_TIMEOUT_S="2"):
        name = start_worker("video")
    assert '"text_encoder": "remote"' in procs.log_path(name).read_text()
    job = submit(client, prompt=f"a lighthouse in a storm {uuid.uuid4().hex[:6]}")
    # Attempts enough to outlast the prewarmer's start, however slow this machine: each one waits 2 s.
    with session_scope(settings) as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(job["id"])).values(max_attempts=100))

    # No prewarmer: the attempt waits for embeddings, then hands the job back with the retryable reason.
    wait_until(
        lambda: "embeddings_unavailable" in reasons(settings, job["id"]),
        timeout_s=60,
        what="the job handed back for want of embeddings",
    )
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] in {"queued", "running"}

    start_prewarmer()  # the next attempt asks it
    done = wait_job(client, job["id"], {"succeeded", "failed"}, timeout_s=90)
    assert done["status"] == "succeeded", done
    assert done["attempt"] >= 2
    assert reasons(settings, job["id"]).count("embeddings_unavailable") == done["attempt"] - 1


def test_an_encoder_free_worker_fails_the_job_with_the_retryable_code_when_attempts_run_out(
    client, settings, start_worker, procs
):
    with process_env(procs, VIDQ_WORKER_TEXT_ENCODER="remote", VIDQ_WORKER_REMOTE_ENCODE_TIMEOUT_S="1"):
        start_worker("video")
    job = submit(client, prompt="a tower in the desert")
    done = wait_job(client, job["id"], {"succeeded", "failed"}, timeout_s=90)
    assert done["status"] == "failed"
    assert done["error"]["code"] == "embeddings_unavailable"
    assert "no prewarmer answered" in done["error"]["message"]
    assert done["attempt"] == settings.max_attempts


def test_jobs_succeed_with_the_cache_redis_gone(client, start_worker, procs):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with process_env(procs, VIDQ_CACHE_L2_URL=dead, VIDQ_CACHE_L3_URL=dead):
        name = start_worker("video")
    jobs = [submit(client, prompt=f"a train crossing a bridge {i}") for i in range(2)]
    for job in jobs:
        assert wait_job(client, job["id"], {"succeeded"}, timeout_s=120)["attempt"] == 1
    assert "cache tier unreachable" in procs.log_path(name).read_text()


def test_vidq_cache_stats_reads_the_cluster_windows(client, settings, start_worker, procs):
    start_worker("video")
    job = submit(client, prompt="a snowy mountain at sunrise")
    wait_job(client, job["id"], {"succeeded"}, timeout_s=120)
    wait_until(lambda: cluster_counts(settings).get("l1:miss", 0) > 0, timeout_s=10, what="flushed counts")
    out = subprocess.run(
        vidq_argv("cache", "stats", "--json", "--windows", "360"),
        env=procs.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    data = json.loads(out.stdout)
    # The job's window may still be the current (incomplete) one: it then shows in no complete window yet.
    assert data["window_s"] == settings.cache_window_s
    assert set(data["totals"]) == {"l1", "l2", "l3", "overall"}
    table = subprocess.run(
        vidq_argv("cache", "stats"), env=procs.env, capture_output=True, text=True, timeout=60, check=True
    )
    assert "embedding cache" in table.stdout
