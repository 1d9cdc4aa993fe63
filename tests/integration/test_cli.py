"""The ``vidq`` entry points the stack, compose and k8s use, run as real processes."""

from __future__ import annotations

import json
import subprocess

import httpx

from tests.integration.helpers import free_port
from tools.processes import vidq_argv, wait_http


def test_create_key_prints_a_working_key(procs, api_url):
    out = subprocess.run(
        vidq_argv("create-key", "--tenant", "cli-tenant"), env=procs.env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    issued = json.loads(out.stdout)
    assert issued["api_key"].startswith("vidq_") and issued["webhook_secret"].startswith("whsec_")
    r = httpx.get(f"{api_url}/v1/jobs", headers={"Authorization": f"Bearer {issued['api_key']}"})
    assert r.status_code == 200 and r.json()["data"] == []


def test_migrate_is_idempotent(procs):
    for _ in range(2):
        out = subprocess.run(vidq_argv("migrate"), env=procs.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "database at head" in out.stdout, out.stderr


def test_flower_serves_the_broker(procs):
    port = free_port()
    procs.start("flower", vidq_argv("flower", "--port", str(port)))
    try:
        wait_http(f"http://127.0.0.1:{port}/healthcheck", timeout_s=60, group=procs)
        assert "Flower" in httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text
    finally:
        procs.stop("flower")


def test_generate_follows_progress_and_saves_the_mp4(procs, api_url, tenant_key, start_worker, tmp_path):
    from shared.render.video import probe

    start_worker("video")
    out = subprocess.run(
        vidq_argv(
            "generate",
            "a boat on a lake",
            "--api",
            api_url,
            "--key",
            tenant_key["api_key"],
            "--width",
            "64",
            "--height",
            "64",
            "--steps",
            "4",
            "--seed",
            "3",
            "--out",
            str(tmp_path),
        ),
        env=procs.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert job["status"] == "succeeded"
    mp4 = tmp_path / f"{job['id']}.mp4"
    assert probe(mp4).codec == "h264" and mp4.stat().st_size == job["output"]["bytes"]
    assert "4/4 steps" in out.stderr  # the progress bar reached the last step
