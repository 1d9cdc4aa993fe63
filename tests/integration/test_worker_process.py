"""The worker as an orchestrator sees it: SIGTERM (a rolling update, a scale-down), metrics and liveness."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil

from shared.infra.storage import Storage
from tests.integration.helpers import free_port, submit, transitions, wait_job
from tools.processes import ProcessGroup, vidq_argv, wait_for_log


def test_sigterm_mid_job_finishes_it_once_then_exits(client, start_worker, procs, settings, tenant_key, hold):
    name = start_worker("video")
    hold.on()
    job = submit(client)
    wait_job(client, job["id"], {"running"}, min_step=1)  # held after its first step
    proc = procs.procs[name]
    os.kill(proc.pid, signal.SIGTERM)  # what Kubernetes sends to the container's main process
    wait_for_log(procs, name, "warm shutdown: finishing the running job", timeout_s=30)
    hold.release()
    assert proc.wait(timeout=120) == 0  # warm shutdown: the running task completes first
    procs.procs.pop(name)
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["attempt"] == 1
    assert transitions(settings, job["id"]) == [("queued", "running", 1), ("running", "succeeded", 1)]
    keys = Storage(settings).list_keys(f"videos/{tenant_key['tenant_id']}/{job['id']}")
    assert sorted(keys) == [
        f"videos/{tenant_key['tenant_id']}/{job['id']}.jpg",
        f"videos/{tenant_key['tenant_id']}/{job['id']}.mp4",
    ]
    # Jobs submitted while no worker runs wait in the queue and complete once one is back.
    later = submit(client, seed=2)  # another render (the same request would be the result cache's)
    start_worker("video")
    assert wait_job(client, later["id"], {"succeeded"})["attempt"] == 1


def test_worker_serves_metrics_and_a_liveness_signal(client, start_worker, procs, tmp_path):
    port = free_port()
    alive = tmp_path / "alive"
    procs.env["VIDQ_WORKER_LIVENESS_FILE"] = str(alive)
    try:
        name = start_worker("video", extra=("--metrics-port", str(port)))
    finally:
        procs.env.pop("VIDQ_WORKER_LIVENESS_FILE")
    env = {**procs.env, "VIDQ_WORKER_LIVENESS_FILE": str(alive)}
    probe = subprocess.run(vidq_argv("worker-alive"), env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr

    job = submit(client)
    wait_job(client, job["id"], {"succeeded"})
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline and 'vidq_worker_jobs_total{outcome="succeeded",pool="stable"}' not in text:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        time.sleep(0.2)
    assert 'vidq_worker_jobs_total{outcome="succeeded",pool="stable"} 1.0' in text
    assert 'vidq_worker_stage_seconds_count{stage="denoise"} 1.0' in text
    assert "vidq_worker_queue_wait_seconds_count" in text

    procs.stop(name)  # a clean stop removes the signal; the probe then fails
    probe = subprocess.run(vidq_argv("worker-alive"), env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 1


def _loads_torch(pid: int) -> bool:
    """Whether torch's shared library is mapped into process ``pid`` (importing torch maps it; nothing unmaps it)."""
    return any("libtorch" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_the_main_process_never_loads_torch(procs, tmp_path):
    """Celery forks the pool process from its main process, and a process that has initialised CUDA cannot fork a
    child that uses it ("Cannot re-initialize CUDA in forked subprocess"). torch decides whether CUDA is there when
    diffusers is imported, so the main process must not import torch at all: only the pool process renders.

    Started by exec, not forked from the test launcher (which holds torch for fast starts)."""
    plain = ProcessGroup(env=dict(procs.env), log_dir=tmp_path)
    proc = plain.start("torch-free", vidq_argv("worker", "--role", "video", "--name", "torch-free"))
    try:
        wait_for_log(plain, "torch-free", "pipeline loaded", timeout_s=180)
        pool = psutil.Process(proc.pid).children()
        assert len(pool) == 1  # concurrency 1: one pool process
        assert _loads_torch(pool[0].pid)  # the pool process rendered with it: the check sees torch where it is
        assert not _loads_torch(proc.pid)
    finally:
        plain.stop_all(timeout_s=10)
