"""What a finished video is about, end to end with a real worker, Postgres (pgvector) and S3: every succeeded job
is described (``output.context``), similar-video search stays within the tenant, the motion filter lists by label
and by prototype, refits are versioned with older assignments still readable, and a failing context step leaves
the job succeeded. The index plans: tests/services/api/test_context_plans.py."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import select

from shared.context import embedding, motion
from shared.infra.db import session_scope
from shared.models import MotionAssignment, VideoContext
from shared.tenants import issue_key
from tests.integration.helpers import TINY, process_env, submit, wait_job
from tools.processes import vidq_argv


def described(client: httpx.Client, job_id: str, *, timeout_s: float = 60) -> dict[str, Any]:
    """The job once its context is stored (the context step runs after the job is final)."""
    job = wait_job(client, job_id, {"succeeded"}, timeout_s=120)
    deadline = time.monotonic() + timeout_s
    while job["output"]["context"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
    assert job["output"]["context"] is not None, job
    return job


@pytest.fixture
def other_client(api_url: str, settings: Any, tenant_key: dict[str, str]) -> Any:
    with session_scope(settings) as session:
        issued = issue_key(session, tenant_name=f"other-{uuid.uuid4().hex[:6]}")
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {issued.api_key}"}, timeout=30) as c:
        yield c


def refit(env: dict[str, str]) -> int:
    out = subprocess.run(vidq_argv("motion-refit"), env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["reason"] == "refitted", report
    return int(report["version"])


def test_videos_are_described_searched_within_their_tenant_and_filtered_by_motion(
    client, other_client, start_worker, settings, procs
):
    start_worker("video")
    mine = [submit(client, seed=seed, prompt=f"{TINY['prompt']} #{seed}") for seed in (1, 2, 3)]
    # Another tenant renders exactly the first video: the most similar video there is, and never to be shown.
    theirs = submit(other_client, seed=1, prompt=f"{TINY['prompt']} #1")
    jobs = [described(client, job["id"]) for job in mine]
    their_job = described(other_client, theirs["id"])

    frames = jobs[0]["num_frames"]
    for job in jobs:
        context = job["output"]["context"]
        assert context["embedding_version"] == embedding.EMBEDDING_VERSION
        assert context["space"] == embedding.space("tiny-wan")
        assert context["keyframes"] == len(embedding.keyframe_indices(frames, temporal_ratio=4))
        assert context["motion"]["label"] in motion.LABELS
        assert context["motion"]["prototype"] is None  # no prototype set fitted yet
    with session_scope(settings) as session:
        rows = {str(r.job_id): r for r in session.scalars(select(VideoContext))}
        assert str(rows[jobs[0]["id"]].tenant_id) != str(rows[their_job["id"]].tenant_id)
        for row in rows.values():
            assert np.linalg.norm(np.asarray(row.embedding)) == pytest.approx(1.0, abs=1e-4)
            assert len(row.motion_tokens) >= 1 and len(row.motion_descriptor) == len(motion.DESCRIPTOR)
        # The same spec rendered for two tenants: the same video, the same embedding.
        same = float(np.dot(rows[jobs[0]["id"]].embedding, rows[their_job["id"]].embedding))
        assert same == pytest.approx(1.0, abs=1e-4)

    similar = client.get(f"/v1/jobs/{jobs[0]['id']}/similar", params={"limit": 10}).raise_for_status().json()
    found = [item["job"]["id"] for item in similar["data"]]
    assert sorted(found) == sorted(j["id"] for j in jobs[1:])  # the tenant's others; never the other tenant's twin
    scores = [item["similarity"] for item in similar["data"]]
    assert scores == sorted(scores, reverse=True) and all(-1.0 <= s <= 1.0 for s in scores)
    assert similar["space"] == embedding.space("tiny-wan")
    assert (
        client.get(f"/v1/jobs/{jobs[0]['id']}/similar", params={"limit": 1}).json()["data"][0]["job"]["id"]
        == (found[0])
    )
    alone = other_client.get(f"/v1/jobs/{their_job['id']}/similar").raise_for_status().json()
    assert alone["data"] == []
    assert other_client.get(f"/v1/jobs/{jobs[0]['id']}/similar").status_code == 404  # another tenant's id
    for bad in (0, 101, "x"):
        assert client.get(f"/v1/jobs/{jobs[0]['id']}/similar", params={"limit": bad}).status_code == 422

    label = jobs[0]["output"]["context"]["motion"]["label"]
    listed = client.get("/v1/jobs", params={"motion": label}).raise_for_status().json()["data"]
    expected = {j["id"] for j in jobs if j["output"]["context"]["motion"]["label"] == label}
    assert {j["id"] for j in listed} == expected
    # The twin has the same motion, and only its own tenant lists it.
    assert [j["id"] for j in other_client.get("/v1/jobs", params={"motion": label}).json()["data"]] == [their_job["id"]]
    for bad in ("sideways", "m1", "m-1.0", "m1.pan_left", "PAN_LEFT", "m01.2"):
        r = client.get("/v1/jobs", params={"motion": bad})
        assert r.status_code == 422, (bad, r.text)
    assert client.get("/v1/jobs", params={"motion": "m999.0"}).json()["data"] == []
    assert client.get("/v1/jobs", params={"motion": label, "status": "failed"}).json()["data"] == []

    # Refit: a versioned set; each video gets its prototype; the filter by prototype finds it.
    first = refit(procs.env)
    job = client.get(f"/v1/jobs/{jobs[0]['id']}").json()
    prototype = job["output"]["context"]["motion"]["prototype"]
    assert prototype is not None and prototype.startswith(f"m{first}.")
    assert job["output"]["context"]["motion"]["variant"].startswith(f"m{first}.{label}.")
    by_prototype = client.get("/v1/jobs", params={"motion": prototype}).json()["data"]
    assert jobs[0]["id"] in {j["id"] for j in by_prototype}
    assert their_job["id"] not in {j["id"] for j in by_prototype}  # the twin shares the prototype, not the tenant

    # The same request again is served from the result cache: the same video, so the same context; its similar
    # videos are the tenant's others, never itself nor the job it reuses.
    again = client.post("/v1/jobs", json={**TINY, "seed": 1, "prompt": f"{TINY['prompt']} #1"}).json()
    assert again["result_of"] == jobs[0]["id"]
    assert client.get(f"/v1/jobs/{again['id']}").json()["output"]["context"] == job["output"]["context"]
    near = client.get(f"/v1/jobs/{again['id']}/similar").json()["data"]
    assert sorted(item["job"]["id"] for item in near) == sorted(j["id"] for j in jobs[1:])

    # A video finished after the refit is assigned to the newest set at once.
    later = described(client, submit(client, seed=4, prompt=f"{TINY['prompt']} #4")["id"])
    assert later["output"]["context"]["motion"]["prototype"].startswith(f"m{first}.")

    # A second refit: a new version; the first set's assignments stay readable and filterable.
    second = refit(procs.env)
    assert second > first
    assert (
        client.get(f"/v1/jobs/{jobs[0]['id']}")
        .json()["output"]["context"]["motion"]["prototype"]
        .startswith(f"m{second}.")
    )
    assert jobs[0]["id"] in {j["id"] for j in client.get("/v1/jobs", params={"motion": prototype}).json()["data"]}
    with session_scope(settings) as session:
        versions = set(
            session.scalars(select(MotionAssignment.version).where(MotionAssignment.job_id == uuid.UUID(jobs[0]["id"])))
        )
    assert versions == {first, second}


def test_a_failing_context_step_leaves_the_job_succeeded(client, start_worker, procs):
    with process_env(procs, VIDQ_WORKER_FAULT_CONTEXT="true"):
        name = start_worker("video")
    job = wait_job(client, submit(client, seed=11)["id"], {"succeeded"}, timeout_s=120)
    assert job["output"]["url"] and job["output"]["context"] is None
    log_path = procs.log_path(name)
    deadline = time.monotonic() + 30
    while "context step failed" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "context step failed" in log_path.read_text()
    r = client.get(f"/v1/jobs/{job['id']}/similar")
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
    # The worker goes on: the next job renders too (and is, again, left without a context).
    assert wait_job(client, submit(client, seed=12)["id"], {"succeeded"}, timeout_s=120)["output"]["context"] is None
