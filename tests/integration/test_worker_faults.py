"""Faults of the worker's own processes: a crashed pool process whose model loads slowly is replaced, a pool that
cannot take jobs fails the liveness probe, and SIGTERM (to the main process or the whole group) is a warm
shutdown that finishes the running job once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import psutil
import pytest

from tests.integration.helpers import process_env, submit, transitions, wait_job
from tools.processes import vidq_argv, wait_for_log, wait_until


def probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(vidq_argv("worker-alive"), env=env, capture_output=True, text=True, timeout=60)


def pool_child(main_pid: int) -> psutil.Process:
    (child,) = psutil.Process(main_pid).children()  # concurrency 1: the one pool process
    return child


def test_a_crashed_pool_process_is_replaced_although_its_model_loads_slowly(client, start_worker, procs, tmp_path):
    # 6 s: more than Celery's 4 s worker_proc_alive_timeout, which used to kill every replacement.
    with process_env(
        procs, VIDQ_WORKER_MODEL_LOAD_DELAY_S="6", VIDQ_WORKER_LIVENESS_FILE=str(tmp_path / "alive")
    ) as env:
        name = start_worker("video")
    log_path = procs.log_path(name)
    first = pool_child(procs.procs[name].pid)
    first.kill()
    first.wait(10)
    job = submit(client)  # sent while the replacement is still loading: it must wait for the model, then run
    assert probe(env).returncode == 0  # loading, within its timeout: alive

    wait_until(
        lambda: log_path.read_text().count("pipeline loaded") == 2,
        timeout_s=90,
        what="the replacement pool process's model",
        watch=procs,
        log_path=log_path,
    )
    assert wait_job(client, job["id"], {"succeeded"}, timeout_s=120)["attempt"] == 1
    assert pool_child(procs.procs[name].pid).pid != first.pid
    assert "Timed out waiting for UP message" not in log_path.read_text()
    assert probe(env).returncode == 0


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [
        # A load that never ends: stuck once it has taken longer than VIDQ_WORKER_MODEL_LOAD_TIMEOUT_S.
        ({"VIDQ_WORKER_MODEL_LOAD_DELAY_S": "3600", "VIDQ_WORKER_MODEL_LOAD_TIMEOUT_S": "3"}, "no pool process ready"),
        # A load that fails ("local" without VIDQ_MODEL_DIR raises): dead at once.
        ({"VIDQ_WORKER_PRELOAD_MODELS": '["local"]', "VIDQ_MODEL_DIR": ""}, "model load failed"),
    ],
    ids=["never-loads", "load-fails"],
)
def test_liveness_fails_when_no_pool_process_can_take_a_job(start_worker, procs, tmp_path, knobs, reason):
    with process_env(procs, VIDQ_WORKER_LIVENESS_FILE=str(tmp_path / "alive"), **knobs) as env:
        name = start_worker("video", wait=False)

    wait_for_log(procs, name, "ready.", timeout_s=120)  # the consumer loop runs: its liveness file alone says alive
    started = time.monotonic()
    result = probe(env)
    while result.returncode == 0 and time.monotonic() - started < 30:
        time.sleep(0.5)
        result = probe(env)
    assert result.returncode == 1, result.stdout
    assert reason in result.stderr
    assert procs.procs[name].poll() is None  # the worker itself runs on: only the probe can get it replaced


def sigterm_mid_job(client, start_worker, procs, hold, *, group: bool) -> tuple[str, dict[str, Any], psutil.Process]:
    """A job held after its first step, then SIGTERM; returns once the worker has begun its warm shutdown."""
    name = start_worker("video")
    hold.on()
    job = submit(client)
    wait_job(client, job["id"], {"running"}, min_step=1)
    pid = procs.procs[name].pid
    child = pool_child(pid)
    if group:
        os.killpg(pid, signal.SIGTERM)  # systemd's KillMode=control-group, `vidq up`'s stop
    else:
        os.kill(pid, signal.SIGTERM)  # what Kubernetes sends to the container's main process
    wait_for_log(procs, name, "warm shutdown: finishing the running job", timeout_s=30)
    return name, job, child


@pytest.mark.parametrize("group", [True, False], ids=["process-group", "main-process"])
def test_sigterm_mid_job_finishes_it_at_attempt_1_then_exits_0(client, start_worker, procs, settings, hold, group):
    name, job, _ = sigterm_mid_job(client, start_worker, procs, hold, group=group)
    hold.release()  # the render goes on after the SIGTERM
    proc = procs.procs[name]
    assert proc.wait(timeout=120) == 0
    procs.procs.pop(name)
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["attempt"] == 1
    assert transitions(settings, job["id"]) == [("queued", "running", 1), ("running", "succeeded", 1)]


@pytest.mark.parametrize("how", ["second-sigterm", "grace-over"])
def test_a_second_sigterm_or_the_end_of_the_grace_period_stops_at_once(client, start_worker, procs, hold, how):
    # The render stays held: it is still running when the second SIGTERM comes or the grace ends.
    with process_env(procs, VIDQ_WORKER_SHUTDOWN_GRACE_S="2" if how == "grace-over" else "600"):
        name, job, child = sigterm_mid_job(client, start_worker, procs, hold, group=True)
    proc = procs.procs[name]
    if how == "second-sigterm":
        os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=40) != 0  # a hard stop: the job is left to its lease, like a crash
    procs.procs.pop(name)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"


def test_cuda_out_of_memory_retries_the_job_once_in_low_vram_and_the_worker_keeps_that_mode(
    client, start_worker, procs
):
    with process_env(procs, VIDQ_WORKER_FAULT_OOM_RENDERS="1"):  # the first render raises torch.OutOfMemoryError
        name = start_worker("video")
    job = wait_job(client, submit(client)["id"], {"succeeded", "failed"}, timeout_s=120)
    assert job["status"] == "succeeded" and job["attempt"] == 1
    assert job["timings"]["memory_mode"] == "low_vram"
    assert "CUDA out of memory; retrying once in low_vram" in procs.log_path(name).read_text()
    after = wait_job(client, submit(client, seed=2)["id"], {"succeeded"}, timeout_s=120)
    assert after["timings"]["memory_mode"] == "low_vram"  # the model stays in low_vram in this worker


def test_out_of_memory_in_low_vram_too_fails_the_job_with_its_code_and_the_worker_lives_on(client, start_worker, procs):
    with process_env(procs, VIDQ_WORKER_FAULT_OOM_RENDERS="2"):  # the render and its low_vram retry
        name = start_worker("video")
    failed = wait_job(client, submit(client)["id"], {"succeeded", "failed"}, timeout_s=120)
    assert failed["status"] == "failed" and failed["attempt"] == 1
    assert failed["error"]["code"] == "out_of_memory"
    assert "low_vram too" in failed["error"]["message"]
    assert procs.procs[name].poll() is None
    assert wait_job(client, submit(client, seed=3)["id"], {"succeeded"}, timeout_s=120)["attempt"] == 1
