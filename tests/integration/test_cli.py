"""The ``vidq`` entry points the stack, compose and k8s use, run as real processes."""

from __future__ import annotations

import json
import subprocess

import httpx

from shared.cli.processes import vidq_argv, wait_http
from tests.integration.conftest import free_port


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
