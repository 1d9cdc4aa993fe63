"""The console (GET /console) in headless Chromium against the real stack: a pasted key, a submitted prompt, the
progress bar moving with each denoising step, the MP4 playing in the page, posters in the job list, the webhook
delivery log, validation errors, a bad key, and another tenant seeing nothing.

The browser tests need Debian's ``chromium`` (driven by Playwright's Python API) and skip without it; the test of
the page's headers and files needs no browser.
``VIDQ_CONSOLE_SCREENSHOT=docs/console.png`` also saves the screenshot the README shows."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.infra.db import session_scope
from shared.tenants import issue_key
from tests.integration.helpers import submit, wait_job

try:
    from playwright import sync_api
except ImportError:  # the dev extra is not installed: the browser tests skip (the browser fixture says so)
    sync_api = None

CHROMIUM = shutil.which("chromium")

# 12 steps of a 224×128, 17-frame clip: a few seconds on a CPU, so the page sees several progress events.
RENDER: dict[str, Any] = {"width": 224, "height": 128, "duration_s": 2.0, "fps": 8, "steps": 12, "seed": 7}
FRAMES = 17  # the smallest 4k+1 covering 2 s × 8 fps
# A small render of several steps, held mid-render by the `hold` fixture.
HELD: dict[str, Any] = {"width": 64, "height": 64, "duration_s": 1.0, "fps": 8, "steps": 8}
WAIT_MS = 120_000  # a hang guard for the render, not a timing assertion

# Every value the progress bar takes, recorded in the page as the console sets it.
RECORD_PROGRESS = """
document.addEventListener("DOMContentLoaded", () => {
  window.progressSeen = [];
  const bar = document.getElementById("job-progress");
  new MutationObserver(() => window.progressSeen.push(Number(bar.getAttribute("value"))))
    .observe(bar, { attributes: true, attributeFilter: ["value"] });
});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if sync_api is None:
        pytest.skip("needs playwright (the dev extra)")
    if CHROMIUM is None:
        pytest.skip("needs the chromium package (apt-get install chromium; .ci/run installs it)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A page in a fresh context (its own sessionStorage); what the page's policy blocked fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    page = context.new_page()
    blocked: list[str] = []
    page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
    yield page
    context.close()
    assert not blocked, blocked


def _open_with_key(page: Any, api_url: str, key: str, fragment: str = "") -> None:
    page.goto(f"{api_url}/console{fragment}")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Use key").click()


def _fill_form(page: Any, *, prompt: str, **values: Any) -> None:
    page.get_by_label("Prompt", exact=True).fill(prompt)
    if "width" in values:
        page.get_by_label("Size").select_option("custom")
    for name, value in values.items():
        page.locator(f"#f-{name}").fill(str(value))


def test_console_is_served_offline_with_a_strict_policy(api_url):
    page = httpx.get(f"{api_url}/console", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    # Everything the page loads comes from /console/ on this origin: no CDN, no web font.
    refs = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert refs and all(ref.startswith("/console/") for ref in refs), refs
    scripts = ["console.js", "api.js", "form.js", "views.js"]
    assets = [(name, "text/javascript") for name in scripts] + [("console.css", "text/css"), ("icon.svg", "image/svg")]
    for name, media in assets:
        asset = httpx.get(f"{api_url}/console/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(media)
        assert "@import" not in asset.text and "url(" not in asset.text
    missing = httpx.get(f"{api_url}/console/app.py", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_bad_key_says_so(page, api_url, clean_state):
    _open_with_key(page, api_url, "vidq_not-a-real-key")
    status = page.locator("#key-status")
    sync_api.expect(status).to_contain_text("Invalid API key")
    sync_api.expect(page.get_by_label("API key")).to_have_attribute("aria-invalid", "true")
    sync_api.expect(page.locator("#jobs-empty")).to_be_visible()


def test_a_phone_screen_gets_one_column_and_no_sideways_scroll(page, api_url):
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{api_url}/console")
    form, detail, jobs = (page.locator(f"section.panel >> nth={i}").bounding_box() for i in range(3))
    assert form["x"] == detail["x"] == jobs["x"] and form["y"] < detail["y"] < jobs["y"]
    assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")


def test_validation_errors_are_shown_by_field(page, api_url, client):
    _open_with_key(page, api_url, client.headers["Authorization"].removeprefix("Bearer "))
    sync_api.expect(page.locator("#key-status")).to_have_text("Key accepted.")

    _fill_form(page, prompt="a kite", width=100, height=64)
    page.get_by_role("button", name="Generate").click()
    sync_api.expect(page.locator("#form-error")).to_contain_text("The API refused this request")
    sync_api.expect(page.locator("#err-width")).to_have_text("width and height must be multiples of 16")
    sync_api.expect(page.locator("#f-width")).to_have_attribute("aria-invalid", "true")

    # An operator's cap (checked after the schema) comes back as a message without a field.
    _fill_form(page, prompt="a kite", width=64, height=64, steps=1_000_000)
    page.get_by_role("button", name="Generate").click()
    sync_api.expect(page.locator("#form-error")).to_contain_text("steps must be at most")
    sync_api.expect(page.locator("#err-width")).to_have_count(0)
    assert client.get("/v1/jobs").json()["data"] == []  # nothing was written


def test_submit_watch_play_list_and_webhooks(page, browser, api_url, client, start_worker, receiver, settings):
    start_worker("all")
    # Two finished jobs already in the list, so it has posters before the page submits its own.
    earlier = [submit(client, prompt=p) for p in ("a lighthouse in a storm", "a paper boat on a stream")]
    for job in earlier:
        assert wait_job(client, job["id"], {"succeeded", "failed"})["status"] == "succeeded"

    page.add_init_script(RECORD_PROGRESS)
    _open_with_key(page, api_url, client.headers["Authorization"].removeprefix("Bearer "))
    sync_api.expect(page.locator("#key-status")).to_have_text("Key accepted.")
    sync_api.expect(page.locator("#job-list .job-card")).to_have_count(2)

    _fill_form(page, prompt="a red fox running through fresh snow", webhook_url=receiver.url, **RENDER)
    page.get_by_role("button", name="Generate").click()
    sync_api.expect(page.locator("#job-status")).to_have_text("succeeded", timeout=WAIT_MS)
    job_id = page.locator("#job-id").text_content()
    assert job_id and page.url.endswith(f"#job={job_id}")

    # The bar moved with the denoising steps: several values between 0 and 100, never backwards, ending at 100.
    seen = page.evaluate("window.progressSeen")
    between = [v for v in seen if 0 < v < 100]
    assert len(set(between)) >= 3 and seen == sorted(seen) and seen[-1] == 100, seen

    # The MP4 from S3 plays in the page, with the clip's duration (frames / fps, to within a frame).
    video = page.locator("#job-video")
    sync_api.expect(video).to_be_visible()
    page.wait_for_function("() => document.getElementById('job-video').readyState >= 2", timeout=30_000)
    duration = page.evaluate("document.getElementById('job-video').duration")
    assert abs(duration - FRAMES / RENDER["fps"]) <= 1 / RENDER["fps"], duration
    page.evaluate("document.getElementById('job-video').play()")
    page.wait_for_function("() => document.getElementById('job-video').currentTime > 0", timeout=30_000)
    assert page.evaluate("document.getElementById('job-video').error") is None

    # The list shows all three jobs with their posters, decoded (not a broken image).
    cards = page.locator("#job-list .job-card")
    sync_api.expect(cards).to_have_count(3)
    sync_api.expect(cards.first).to_have_attribute("data-job-id", job_id)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#job-list .job-card img')]"
        ".filter((img) => img.complete && img.naturalWidth > 0).length === 3",
        timeout=30_000,
    )
    assert page.evaluate("document.querySelector('#job-list .job-card img').naturalWidth") == RENDER["width"]

    # The webhook went out, and the delivery log shows it (the page looks again until a delivery is on record).
    assert receiver.event.wait(30), "no webhook received"
    row = page.locator("#webhook-rows tr").first
    sync_api.expect(row).to_contain_text("delivered · 204", timeout=30_000)
    sync_api.expect(row).to_contain_text("job.succeeded")

    # Once the worker has described the video, the page shows the tenant's two other videos as similar ones, and
    # the motion it found.
    similar = page.locator("#similar-list .job-card")
    sync_api.expect(similar).to_have_count(2, timeout=30_000)
    sync_api.expect(similar.first).to_contain_text("alike")
    assert {similar.nth(i).get_attribute("data-job-id") for i in range(2)} == {j["id"] for j in earlier}
    sync_api.expect(page.locator("#job-facts")).to_contain_text("motion", timeout=30_000)

    # Picking an earlier job from the list shows it, with its own video.
    page.locator(f'#job-list .job-card[data-job-id="{earlier[0]["id"]}"]').click()
    sync_api.expect(page.locator("#job-prompt")).to_have_text("a lighthouse in a storm")
    sync_api.expect(page.locator("#job-webhooks")).to_be_hidden()
    page.wait_for_function("() => document.getElementById('job-video').readyState >= 1", timeout=30_000)
    page.locator(f'#job-list .job-card[data-job-id="{job_id}"]').click()
    sync_api.expect(page.locator("#webhook-rows tr").first).to_contain_text("delivered · 204")
    page.wait_for_function("() => document.getElementById('job-video').readyState >= 2", timeout=30_000)
    _screenshot(page)

    # Another tenant's key, in a fresh browser context, sees none of these jobs, not even by id.
    with session_scope(settings) as session:
        other = issue_key(session, tenant_name=f"other-{uuid.uuid4().hex[:6]}")
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        stranger = context.new_page()
        _open_with_key(stranger, api_url, other.api_key, fragment=f"#job={job_id}")
        sync_api.expect(stranger.locator("#key-status")).to_have_text("Key accepted.")
        sync_api.expect(stranger.locator("#job-empty")).to_have_text(f"Job {job_id} not found.")
        sync_api.expect(stranger.locator("#jobs-empty")).to_be_visible()
        assert stranger.locator("#job-list .job-card").count() == 0
    finally:
        context.close()


def test_cancel_stops_a_running_job(page, api_url, client, start_worker, hold):
    start_worker("video")
    hold.on()  # the render holds after each step until cancelled: it is surely running when Cancel is clicked
    _open_with_key(page, api_url, client.headers["Authorization"].removeprefix("Bearer "))
    sync_api.expect(page.locator("#key-status")).to_have_text("Key accepted.")
    _fill_form(page, prompt="a slow sunrise over the sea", **HELD)
    page.get_by_role("button", name="Generate").click()
    sync_api.expect(page.locator("#job-status")).to_have_text("running", timeout=WAIT_MS)
    page.get_by_role("button", name="Cancel", exact=True).click()
    sync_api.expect(page.locator("#job-status")).to_have_text("cancelled", timeout=WAIT_MS)
    sync_api.expect(page.get_by_role("button", name="Cancel", exact=True)).to_be_hidden()
    sync_api.expect(page.locator("#job-video")).to_be_hidden()
    job = client.get(f"/v1/jobs/{page.locator('#job-id').text_content()}").json()
    assert job["status"] == "cancelled" and job["progress"]["step"] < HELD["steps"]


def test_the_job_list_pages_with_load_more(page, api_url, client):
    # Queued jobs (no worker runs here) are enough: one more than a page of the console's 12.
    ids = [submit(client, prompt=f"a numbered tile {i}", seed=i)["id"] for i in range(13)]
    _open_with_key(page, api_url, client.headers["Authorization"].removeprefix("Bearer "))
    cards = page.locator("#job-list .job-card")
    sync_api.expect(cards).to_have_count(12)
    page.get_by_role("button", name="Load more").click()
    sync_api.expect(cards).to_have_count(13)
    sync_api.expect(page.get_by_role("button", name="Load more")).to_be_hidden()
    shown = [cards.nth(i).get_attribute("data-job-id") for i in range(13)]
    assert shown == ids[::-1]  # newest first, none twice


def _screenshot(page: Any) -> None:
    target = os.environ.get("VIDQ_CONSOLE_SCREENSHOT")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=target, full_page=True)
