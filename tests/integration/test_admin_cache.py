"""GET /v1/admin/cache/stats: absent (404) while VIDQ_ADMIN_TOKEN is empty, 401 for any other credential, and with
the token the cluster's hit counts per tier as the workers' counters wrote them to this session's broker keys, hit
rates included. Redis failures (the 503 envelope) and the event loop kept free are checked in process:
tests/services/api/test_admin_cache.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from shared.infra.config import Settings
from shared.textcache.monitor import HitCounter, mode_key
from tests.integration.helpers import free_port
from tools.processes import ProcessGroup, vidq_argv, wait_http

TOKEN = f"operator-{os.urandom(12).hex()}"
PATH = "/v1/admin/cache/stats"


@pytest.fixture(scope="module")
def admin_api(procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second API process, the same stack and broker key prefix as the session's, with VIDQ_ADMIN_TOKEN set."""
    group = ProcessGroup(
        env={**procs.env, "VIDQ_ADMIN_TOKEN": TOKEN}, log_dir=tmp_path_factory.mktemp("admin-api"), spawn=procs.spawn
    )
    port = free_port()
    group.start("api-admin", vidq_argv("api", "--no-migrate", "--port", str(port)))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", timeout_s=60, group=group)
        yield url
    finally:
        group.stop_all(timeout_s=10)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- off, wrong credentials --------------------------------------------------------------------------------------


def test_without_a_token_configured_the_endpoint_does_not_exist(
    api_url: str, procs: ProcessGroup, settings: Settings
) -> None:
    if procs.env.get("VIDQ_ADMIN_TOKEN") or settings.admin_token:
        pytest.skip("this session's API has VIDQ_ADMIN_TOKEN set")
    unknown = httpx.get(f"{api_url}/v1/admin/no-such-thing")
    assert unknown.status_code == 404
    cases: list[tuple[dict[str, str], dict[str, str]]] = [
        ({}, {}),
        (bearer("anything"), {}),
        (bearer("x"), {"windows": "abc"}),
        ({}, {"windows": "0"}),
    ]
    for headers, params in cases:
        r = httpx.get(f"{api_url}{PATH}", headers=headers, params=params)
        assert r.status_code == 404, r.text
        assert r.json() == unknown.json(), "the same answer as any unknown path"
        assert r.json()["error"]["code"] == "not_found"


def test_a_missing_or_wrong_token_is_401(admin_api: str, tenant_key: dict[str, str]) -> None:
    attempts: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer"},
        bearer("wrong"),
        bearer(TOKEN[:-1]),
        bearer(TOKEN + "x"),
        bearer(tenant_key["api_key"]),  # a tenant's API key is not the operator token
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
    ]
    for headers in attempts:
        r = httpx.get(f"{admin_api}{PATH}", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        error = r.json()["error"]
        assert error["code"] == "unauthorized" and "VIDQ_ADMIN_TOKEN" in error["message"]
    # Checked before the query: a wrong token learns nothing about the parameters either.
    assert httpx.get(f"{admin_api}{PATH}", params={"windows": 0}, headers=bearer("wrong")).status_code == 401


def test_windows_out_of_range_is_422(admin_api: str) -> None:
    for windows in ("0", "361", "-1", "six"):
        r = httpx.get(f"{admin_api}{PATH}", params={"windows": windows}, headers=bearer(TOKEN))
        assert r.status_code == 422, (windows, r.text)
        assert r.json()["error"]["code"] == "invalid_request"


# ---- the counts ---------------------------------------------------------------------------------------------------


def write_counts(settings: Settings, counts: dict[tuple[str, str], int], *, at: float) -> None:
    """What a worker's counter flushes: its lookups, into the window holding ``at``."""
    client = redis.Redis.from_url(str(settings.broker_url))
    try:
        counter = HitCounter(
            client,
            prefix=settings.broker_key_prefix,
            window_s=settings.cache_window_s,
            retention_s=settings.cache_window_retention_s,
        )
        for (tier, result), n in counts.items():
            counter.record(tier, result, n)
        counter.flush(now=at)
    finally:
        client.close()


def tier(hits: int, misses: int, rate: float | None) -> dict[str, Any]:
    return {"hits": hits, "misses": misses, "hit_rate": rate}


EMPTY = tier(0, 0, None)


def test_the_token_shows_the_counted_windows_with_their_hit_rates(
    admin_api: str, settings: Settings, clean_state: None
) -> None:
    """clean_state removed this session's broker keys: the windows hold what this test writes, and nothing else."""
    window_s = settings.cache_window_s
    now = time.time()
    last, before = now - window_s, now - 2 * window_s  # the current - 1 and current - 2 windows
    # Every lookup starts at L1; its misses go on to L2, L2's to L3, L3's are encoded.
    write_counts(
        settings,
        {
            ("l1", "hit"): 30,
            ("l1", "miss"): 10,
            ("l2", "hit"): 6,
            ("l2", "miss"): 4,
            ("l3", "hit"): 1,
            ("l3", "miss"): 3,
        },
        at=last,
    )
    write_counts(settings, {("l1", "hit"): 5, ("l1", "miss"): 5, ("l2", "miss"): 5}, at=before)
    with redis.Redis.from_url(str(settings.broker_url)) as client:
        client.set(mode_key(settings.broker_key_prefix), "compensating", ex=60)

    r = httpx.get(f"{admin_api}{PATH}", headers=bearer(TOKEN))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["window_s"] == window_s and body["mode"] == "compensating"
    assert len(body["windows"]) == 6, "the default: six windows"
    starts = [w["start"] for w in body["windows"]]
    assert starts == sorted(starts) and all(b - a == window_s for a, b in zip(starts, starts[1:], strict=False))
    by_start = {w["start"]: w for w in body["windows"]}
    # Written "one window ago": the newest complete window, or the one before if a window ended meanwhile.
    newest = by_start.pop(int(last // window_s) * window_s)
    older = by_start.pop(int(before // window_s) * window_s)
    assert {k: newest[k] for k in ("l1", "l2", "l3", "overall")} == {
        "l1": tier(30, 10, 0.75),
        "l2": tier(6, 4, 0.6),
        "l3": tier(1, 3, 0.25),
        # 37 of the 40 lookups found an embedding in some tier; 3 were encoded.
        "overall": tier(37, 3, 0.925),
    }
    assert {k: older[k] for k in ("l1", "l2", "l3", "overall")} == {
        "l1": tier(5, 5, 0.5),
        "l2": tier(0, 5, 0.0),
        "l3": EMPTY,
        "overall": tier(5, 5, 0.5),
    }
    assert all(w[t] == EMPTY for w in by_start.values() for t in ("l1", "l2", "l3", "overall"))
    assert body["totals"] == {
        "l1": tier(35, 15, 0.7),
        "l2": tier(6, 9, 0.4),
        "l3": tier(1, 3, 0.25),
        "overall": tier(42, 8, 0.84),
    }

    one = httpx.get(f"{admin_api}{PATH}", params={"windows": 1}, headers=bearer(TOKEN)).json()
    assert len(one["windows"]) == 1 and one["windows"][0]["start"] == starts[-1]
    assert len(httpx.get(f"{admin_api}{PATH}", params={"windows": 360}, headers=bearer(TOKEN)).json()["windows"]) == 360


def test_without_counts_or_a_prewarmer_every_rate_is_null(admin_api: str, clean_state: None) -> None:
    body = httpx.get(f"{admin_api}{PATH}", params={"windows": 3}, headers=bearer(TOKEN)).json()
    assert body["mode"] == "unknown"
    assert body["totals"] == dict.fromkeys(("l1", "l2", "l3", "overall"), EMPTY)
    assert [{k: v for k, v in w.items() if k != "start"} for w in body["windows"]] == [body["totals"]] * 3


def test_no_request_with_the_token_causes_a_server_error(admin_api: str) -> None:
    """test_api_fuzz.py meets the operator endpoints switched off (404); here they are on, with the right token."""
    import schemathesis
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings

    schema = schemathesis.openapi.from_url(f"{admin_api}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().path.startswith("/v1/admin/")]
    assert PATH in [o.path for o in operations]  # and the worker pools' (services/api/admin/pools.py)

    for operation in operations:

        @given(case=operation.as_strategy())
        @hsettings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            case.headers = {**(case.headers or {}), **bearer(TOKEN)}
            response = case.call(timeout=30)
            # 404: a tenant endpoint's unknown tenant (the pools' rules are made on first use: no 404 for them)
            assert response.status_code in {200, 404, 422}, (
                f"{case.formatted_path} → {response.status_code}: {response.text}"
            )
            case.validate_response(
                response,
                checks=[schemathesis.checks.status_code_conformance, schemathesis.checks.response_schema_conformance],
            )

        check()
