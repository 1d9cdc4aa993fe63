"""The REST contract against the real API process and Postgres: validation, auth, tenants, idempotency, lists."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis
from sqlalchemy import func, select

from shared.infra.db import session_scope
from shared.models import IdempotencyKey, Job
from shared.queues import Queue
from shared.spec import GenerationSpec
from tests.integration.helpers import TINY, queue_key, submit


def job_count(settings) -> int:
    with session_scope(settings) as session:
        return int(session.execute(select(func.count()).select_from(Job)).scalar_one())


BAD_BODIES = {
    "empty prompt": {"prompt": ""},
    "prompt too long": {"prompt": "x" * 2001},
    "negative prompt too long": {"negative_prompt": "x" * 2001},
    "duration too long": {"duration_s": 10.5},
    "duration zero": {"duration_s": 0},
    "fps too high": {"fps": 31},
    "width not multiple of 16": {"width": 100, "height": 64},
    "height not multiple of 16": {"width": 64, "height": 70},
    "too many pixels": {"width": 1920, "height": 1088},
    "width without height": {"width": 64, "height": None},
    "preset and size": {"resolution": "480p"},
    "unknown preset": {"resolution": "8k", "width": None, "height": None},
    "too many frames": {"duration_s": 10.0, "fps": 30},
    "steps zero": {"steps": 0},
    "steps too many": {"steps": 101},
    "guidance too high": {"guidance_scale": 25},
    "negative seed": {"seed": -1},
    "unknown model": {"model": "sora"},
    "bad webhook scheme": {"webhook_url": "ftp://example.com/hook"},
    "webhook with credentials": {"webhook_url": "https://user:pw@example.com/hook"},
    "metadata too big": {"metadata": {"k": "v" * 5000}},
    "metadata nested": {"metadata": {"k": {"nested": 1}}},
    "unknown field": {"frames": 33},
    "NUL in prompt": {"prompt": "a\x00b"},
    "NUL in metadata key": {"metadata": {"k\x00": 1}},
    "NUL in metadata value": {"metadata": {"k": "a\x00"}},
    "empty metadata key": {"metadata": {"": 1}},
    "wrong type": {"steps": "many"},
    "unknown precision": {"precision": "turbo"},
    "precision in capitals": {"precision": "FAST"},
    "precision not a string": {"precision": 8},
    "unknown step cache": {"step_cache": "taylor9"},
    "step cache null": {"step_cache": None},
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_every_cap_is_a_clear_422_and_writes_nothing(client, settings, name):
    before = job_count(settings)
    r = client.post("/v1/jobs", json={**TINY, **BAD_BODIES[name]})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["message"]
    assert job_count(settings) == before


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b'{"prompt": "a", "metadata": {"x": NaN}}',
        b'{"prompt": "a", "metadata": {"x": Infinity}}',
        b'{"prompt": "\\ud800"}',
        b"[]",
        b"null",
    ],
)
def test_malformed_json_is_422(client, settings, raw):
    before = job_count(settings)
    r = client.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert job_count(settings) == before


def test_an_unknown_step_cache_is_a_422_that_names_it_and_its_presets(client, settings):
    r = client.post("/v1/jobs", json={**TINY, "step_cache": "always"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["message"] == "step_cache must be one of 'off', 'taylor2', 'taylor3', 'taylor4'"
    assert [d["loc"] for d in error["details"]] == [["body", "step_cache"]]
    assert job_count(settings) == 0


def test_an_unknown_precision_is_a_422_that_names_it_and_writes_and_sends_nothing(client, settings):
    r = client.post("/v1/jobs", json={**TINY, "precision": "turbo"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == "precision must be 'exact' or 'fast', or left out for the worker's default"
    assert [d["loc"] for d in error["details"]] == [["body", "precision"]]
    assert job_count(settings) == 0
    broker = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)
    try:
        assert [broker.llen(queue_key(settings, q.value)) for q in Queue] == [0] * len(Queue)
    finally:
        broker.close()


def stored_spec(settings, job_id: str) -> tuple[dict, str | None]:
    with session_scope(settings) as session:
        job = session.get(Job, uuid.UUID(job_id))
        assert job is not None
        return dict(job.spec), job.result_key


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_named_precision_is_stored_and_shown_on_every_read(client, settings, precision):
    job = submit(client, precision=precision)
    assert job["precision"] == precision
    spec, key = stored_spec(settings, job["id"])
    assert spec["precision"] == precision and key == GenerationSpec.from_dict(spec).result_key()
    assert client.get(f"/v1/jobs/{job['id']}").json()["precision"] == precision
    assert [j["precision"] for j in client.get("/v1/jobs").json()["data"]] == [precision]


def test_a_job_that_names_no_precision_shows_null_and_stores_todays_spec_and_key(client, settings):
    job = submit(client)
    assert job["precision"] is None
    spec, key = stored_spec(settings, job["id"])
    assert "precision" not in spec  # stored as before the field existed
    without = GenerationSpec.from_dict(spec)
    assert without.precision is None and key == without.result_key()
    assert key != without.model_copy(update={"precision": "exact"}).result_key()
    assert client.get(f"/v1/jobs/{job['id']}").json()["precision"] is None
    assert [j["precision"] for j in client.get("/v1/jobs").json()["data"]] == [None]
    # Naming a precision is another request for Idempotency-Key; leaving it out (or null) is the same one.
    headers = {"Idempotency-Key": "precision-1"}
    first = client.post("/v1/jobs", json=TINY, headers=headers)
    assert client.post("/v1/jobs", json={**TINY, "precision": None}, headers=headers).json()["id"] == first.json()["id"]
    other = client.post("/v1/jobs", json={**TINY, "precision": "exact"}, headers=headers)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"


def test_openapi_documents_precision(api_url):
    schemas = httpx.get(f"{api_url}/openapi.json").json()["components"]["schemas"]
    for name in ("JobCreate", "JobOut"):
        field = schemas[name]["properties"]["precision"]
        assert {"enum": ["exact", "fast"], "type": "string"} in field["anyOf"], (name, field)
        assert "worker's default" in field["description"] and "8-bit" in field["description"], name
    assert "precision" not in schemas["JobCreate"].get("required", [])
    for name in ("JobCreate", "JobOut"):
        field = schemas[name]["properties"]["step_cache"]
        assert field["enum"] == ["off", "taylor2", "taylor3", "taylor4"] and field["default"] == "off", (name, field)
        assert "depends on the model's trained weights" in field["description"], name


def test_resolution_preset_and_frames_are_derived(client):
    job = submit(client, width=None, height=None, resolution="480p", duration_s=2.0, fps=16)
    assert (job["width"], job["height"], job["num_frames"]) == (832, 480, 33)


def test_auth_is_required(api_url):
    assert httpx.post(f"{api_url}/v1/jobs", json=TINY).status_code == 401
    r = httpx.get(f"{api_url}/v1/jobs", headers={"Authorization": "Bearer vidq_wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_another_tenants_job_is_404(client, api_url, settings):
    from shared.tenants import issue_key

    job = submit(client)
    with session_scope(settings) as session:
        other = issue_key(session, tenant_name="someone-else")
    headers = {"Authorization": f"Bearer {other.api_key}"}
    for method, path in [("GET", ""), ("POST", "/cancel"), ("GET", "/webhooks")]:
        r = httpx.request(method, f"{api_url}/v1/jobs/{job['id']}{path}", headers=headers)
        assert r.status_code == 404, (method, path, r.text)
    assert httpx.get(f"{api_url}/v1/jobs", headers=headers).json()["data"] == []
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200


def test_unknown_and_malformed_ids(client):
    assert client.get("/v1/jobs/00000000-0000-0000-0000-000000000000").status_code == 404
    assert client.get("/v1/jobs/not-a-uuid").status_code == 422


def test_idempotency_key_same_body_same_job_other_body_refused(client, settings):
    headers = {"Idempotency-Key": "order-123"}
    first = client.post("/v1/jobs", json=TINY, headers=headers)
    again = client.post("/v1/jobs", json=TINY, headers=headers)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert job_count(settings) == 1
    other = client.post("/v1/jobs", json={**TINY, "prompt": "something else"}, headers=headers)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert job_count(settings) == 1
    with session_scope(settings) as session:
        assert session.execute(select(func.count()).select_from(IdempotencyKey)).scalar_one() == 1


def test_list_newest_first_with_status_filter_and_cursor(client):
    ids = [submit(client, seed=i)["id"] for i in range(5)]
    client.post(f"/v1/jobs/{ids[1]}/cancel").raise_for_status()
    page1 = client.get("/v1/jobs", params={"limit": 2}).json()
    page2 = client.get("/v1/jobs", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    page3 = client.get("/v1/jobs", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
    seen = [j["id"] for p in (page1, page2, page3) for j in p["data"]]
    assert seen == ids[::-1] and page3["next_cursor"] is None
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}).json()["data"]
    assert [j["id"] for j in cancelled] == [ids[1]]
    assert client.get("/v1/jobs", params={"status": "bogus"}).status_code == 422
    assert client.get("/v1/jobs", params={"cursor": "!!"}).status_code == 422


def test_health_ready_metrics_and_openapi(api_url, client):
    assert httpx.get(f"{api_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{api_url}/readyz").json()
    assert ready["checks"] == {"postgres": "ok", "redis": "ok", "s3": "ok"}
    submit(client)
    metrics = httpx.get(f"{api_url}/metrics").text
    assert "vidq_api_submits_total" in metrics and "vidq_api_request_seconds_bucket" in metrics
    assert 'vidq_api_errors_total{code="invalid_request",status="422"}' in metrics
    assert "/v1/jobs" in httpx.get(f"{api_url}/openapi.json").json()["paths"]
