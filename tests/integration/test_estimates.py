"""ETA quotes end to end: a real worker renders, its measured costs reach the API, and the quote of a waiting job
lies within the spread of the renders it was made from (how close quotes come on a quiet machine is
benchmarks/eta_replay.py's to measure, not a test's)."""

from __future__ import annotations

from datetime import datetime

from tests.integration.helpers import submit, wait_job
from tools.processes import wait_until


def render_seconds(job: dict) -> float:
    """What the job cost the worker, as its cost sample records it: claim to rendered, its finish overlapping the
    next job's render."""
    return float(job["timings"]["occupied"])


def test_a_queued_jobs_quote_lies_within_the_renders_it_was_made_from(client, start_worker, hold):
    start_worker("video")
    first = submit(client, seed=50)
    assert first["estimate"] is None  # nothing measured yet: no quote
    ids = [first["id"], *(submit(client, seed=i)["id"] for i in range(3))]
    done = [wait_job(client, job_id, {"succeeded"}) for job_id in ids]
    # A quote is the median of whichever of these samples its view had read (refreshes run on their own clock, and
    # the first render, cold, is often the slowest): the median of any of them lies within the spread of all.
    spread = sorted(render_seconds(j) for j in done)
    assert all(j["estimate"] is None for j in done)  # finished: no quote

    hold.on()  # the next render holds mid-way, so the job after it waits
    running = submit(client, seed=100)
    wait_job(client, running["id"], {"running"}, min_step=1)
    waiting = submit(client, seed=101)

    def quoted() -> dict | None:
        return client.get(f"/v1/jobs/{waiting['id']}").raise_for_status().json()["estimate"]

    def sees_the_held_render() -> bool:  # admitted here, or read running by a refresh: the held render is ahead
        quote = quoted()
        return quote is not None and quote["work_ahead_s"] > 0

    wait_until(sees_the_held_render, timeout_s=30, what="a quote for the waiting job, with the held render ahead")
    quote = quoted()
    assert quote is not None
    assert spread[0] - 1e-3 <= quote["gpu_seconds"] <= spread[-1] + 1e-3, (quote, spread)
    assert quote["workers"] >= 1
    start, finish = datetime.fromisoformat(quote["start_at"]), datetime.fromisoformat(quote["finish_at"])
    assert finish > start
    running_quote = client.get(f"/v1/jobs/{running['id']}").json()["estimate"]
    assert running_quote is not None and running_quote["work_ahead_s"] == 0
    hold.release()
    wait_job(client, waiting["id"], {"succeeded"})
