"""The render costs the ETA quotes stand on (shared/scheduling/costs.py), recorded to and read from real Redis,
and the work-ahead arithmetic of a quote (services/api/jobs/estimates.py). Marked integration by tests/conftest.py,
through the ``settings`` fixture."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.api.jobs.estimates import Backlog, View
from shared.infra.redis_clients import broker_client
from shared.scheduling import costs
from shared.spec import GenerationSpec
from tests.conftest import _delete_broker_keys

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def spec(frames: int = 9, height: int = 64, width: int = 64, steps: int = 4, model: str = "tiny-wan"):
    return GenerationSpec(
        prompt="boat",
        negative_prompt="",
        guidance_scale=5.0,
        model=model,
        width=width,
        height=height,
        num_frames=frames,
        fps=8,
        steps=steps,
        seed=1,
    )


@pytest.fixture
def own(settings):
    prefix = f"{settings.broker_key_prefix}eta-{os.urandom(3).hex()}:"
    mine = settings.model_copy(update={"broker_key_prefix": prefix, "eta_samples": 5})
    yield mine
    _delete_broker_keys(str(mine.broker_url), prefix)


def test_a_cost_is_the_median_of_the_renders_of_its_shape(own):
    client = broker_client(own)
    for denoise, elapsed in [(2.0, 3.75), (4.0, 6.25), (3.0, 4.75)]:
        costs.record(client, own, spec(), {"denoise": denoise, "total": elapsed - 1, "elapsed": elapsed})
    model = costs.load(client, own)
    # Each job held the worker from claim to finalize: 3.75, 6.25, 4.75 → median 4.75.
    assert model.cost_s(spec()) == pytest.approx(4.75)
    # Twice the steps: the denoising part doubles (fixed + 2 × denoise: 5.75, 10.25, 7.75 → 7.75).
    assert model.cost_s(spec(steps=8)) == pytest.approx(7.75)


def test_a_batch_member_is_charged_its_share(own):
    client = broker_client(own)
    costs.record(client, own, spec(), {"denoise": 4.0, "elapsed": 8.0, "batch": 4.0})
    assert costs.load(client, own).cost_s(spec()) == pytest.approx(2.0)


def test_only_the_last_samples_count(own):
    client = broker_client(own)
    for _ in range(10):
        costs.record(client, own, spec(), {"denoise": 100.0, "total": 100.0})
    for _ in range(5):  # eta_samples = 5: the old, slow renders are gone
        costs.record(client, own, spec(), {"denoise": 1.0, "total": 1.0})
    assert costs.load(client, own).cost_s(spec()) == pytest.approx(1.0)


def test_an_unmeasured_shape_is_scaled_from_the_nearest_of_its_model(own):
    client = broker_client(own)
    costs.record(client, own, spec(frames=9), {"denoise": 2.0, "total": 2.0})
    costs.record(client, own, spec(frames=33, height=128, width=128), {"denoise": 40.0, "total": 40.0})
    model = costs.load(client, own)
    assert model.cost_s(spec(frames=17)) == pytest.approx(2.0 * 17 / 9)  # nearest: the 9-frame shape
    assert model.cost_s(spec(model="wan2.1-1.3b-arch")) is None  # never measured: no quote


def view_of(
    queues: dict[str, dict[uuid.UUID, list[tuple[int, float]]]], *, added: bool = False, **fields: object
) -> View:
    """A view holding ``queues``: class → tenant → (seconds after T0 it was created, cost) per job."""
    view = View(costs=costs.CostModel({}), **fields)  # type: ignore[arg-type]
    for klass, tenants in queues.items():
        for tenant, jobs in tenants.items():
            for at, cost in jobs:
                view.add(klass, tenant, T0 + timedelta(seconds=at), cost, seen=not added)
    return view


def test_work_ahead_counts_higher_classes_own_older_jobs_and_fair_turns_of_others():
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    def waiting(n: int, cost: float) -> list[tuple[int, float]]:
        return [(i, cost) for i in range(n)]

    view = view_of(
        {"high": {c: waiting(2, 10.0)}, "low": {a: waiting(100, 1.0), b: waiting(3, 2.0)}},
        workers=2,
        running_s=5.0,
        weights={b: 2.0},
    )
    # b's new low job: running 5 + high 20 + b's own 3 older (6) + a's turns: 4 turns of b at weight 2 vs 1 → 2 of a.
    assert view.work_ahead_s("low", b, T0 + timedelta(hours=1)) == pytest.approx(5 + 20 + 6 + 2)
    # a's 10th job: its 9 older (9) + b's turns: 10 turns × 2/1 → all 3 of b (6).
    assert view.work_ahead_s("low", a, T0 + timedelta(seconds=9)) == pytest.approx(5 + 20 + 9 + 6)
    # A high job waits only for the running work and the older high jobs.
    assert view.work_ahead_s("high", c, T0 + timedelta(hours=1)) == pytest.approx(5 + 20)


def test_the_view_ages_with_the_work_done_since_it_was_read():
    a = uuid.uuid4()
    view = view_of({"low": {a: [(0, 4.0)]}}, workers=2, running_s=2.0, taken_at=T0)
    view.add("low", a, T0 + timedelta(seconds=1), 1.0, seen=False)  # admitted by this process since
    later = T0 + timedelta(hours=1)
    assert view.work_ahead_s("low", a, later, now=T0) == pytest.approx(2 + 4 + 1)
    # One second later two workers did 2 s of the 6 s they were seen with; what was admitted since counts whole.
    assert view.work_ahead_s("low", a, later, now=T0 + timedelta(seconds=1)) == pytest.approx(4 + 1)
    assert view.work_ahead_s("low", a, later, now=T0 + timedelta(seconds=60)) == pytest.approx(1)


def test_a_job_out_of_order_takes_its_place_in_its_tenants_backlog():
    backlog = Backlog()
    for at, cost in [(0, 1.0), (2, 4.0), (1, 2.0)]:
        backlog.add(T0 + timedelta(seconds=at), cost)
    assert backlog.created == [T0 + timedelta(seconds=s) for s in (0, 1, 2)]
    assert [backlog.cost_of_first(n) for n in range(5)] == [0.0, 1.0, 3.0, 7.0, 7.0]
    assert backlog.older_than(T0 + timedelta(seconds=2)) == 2


def test_queued_jobs_past_the_refreshs_limit_count_as_typical_jobs_ahead():
    a = uuid.uuid4()
    view = view_of({"high": {a: [(0, 1.0)]}, "low": {a: [(0, 1.0)]}}, workers=1)
    view.unread_s = {"high": 30.0, "low": 50.0}
    assert view.work_ahead_s("high", a, T0 + timedelta(hours=1)) == pytest.approx(30 + 1)
    assert view.work_ahead_s("low", a, T0 + timedelta(hours=1)) == pytest.approx(30 + 1 + 50 + 1)
