"""Fair share between tenants inside a class (shared/jobs/fairness.py), against real Postgres: the order claims
take, weights, a tenant rejoining after being idle, and what is never a candidate. Marked integration by
tests/conftest.py, through the ``settings`` fixture."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import pytest
from sqlalchemy import func, update

from services.api.jobs.service import create_job
from shared.infra.db import session_scope
from shared.jobs.fairness import claim_next
from shared.jobs.schemas import JobCreate
from shared.jobs.states import succeed
from shared.models import Job
from shared.queues import PriorityClass
from shared.tenants import get_or_create_tenant

BODY = {"prompt": "boat", "width": 64, "height": 64, "duration_s": 3.0, "fps": 4, "steps": 2}


def queue(settings, tenant: str, n: int, *, sent: bool = True) -> list[uuid.UUID]:
    """``n`` jobs of ``tenant``, oldest first, all of one class; ``sent``: their messages are out."""
    ids = []
    for i in range(n):  # one transaction each, as submits are: each job its own created_at
        with session_scope(settings) as session:
            owner = get_or_create_tenant(session, tenant)
            job = create_job(session, settings, tenant=owner, body=JobCreate(**BODY, seed=i))
            assert job.priority_class == PriorityClass.LOW.value
            ids.append(job.id)
    if sent:
        with session_scope(settings) as session:
            session.execute(update(Job).where(Job.id.in_(ids)).values(enqueued_at=func.now()))
    return ids


def claims(settings, n: int, *, offered: uuid.UUID | None = None, weights: Mapping[str, float] = {}) -> list[str]:
    """The tenants of the next ``n`` claims of the low class, in order (each claimed job then finishes)."""
    order = []
    for _ in range(n):
        with session_scope(settings) as session:
            job = claim_next(
                session,
                PriorityClass.LOW,
                offered=offered or uuid.uuid4(),
                worker_id="w",
                lease_s=30,
                weights=weights,
            )
            if job is None:
                break
            order.append(job.tenant_id)
            succeed(session, job.id, token=job.attempt, output={})
    with session_scope(settings) as session:
        by_id = {get_or_create_tenant(session, name).id: name for name in ("a", "b", "c")}
    return [by_id[t] for t in order]


@pytest.fixture
def clean(settings, clean_state):
    return settings


def test_a_newcomer_starts_within_a_slot_or_two_of_a_tenant_with_a_long_queue(clean):
    a = queue(clean, "a", 40)
    claims(clean, 5)  # a has been running alone for a while
    queue(clean, "b", 3)
    order = claims(clean, 8)
    assert order == ["b", "a", "b", "a", "b", "a", "a", "a"]
    assert len(a) == 40


def test_jobs_of_one_tenant_start_oldest_first(clean):
    ids = queue(clean, "a", 5)
    started = []
    for _ in range(5):
        with session_scope(clean) as session:
            job = claim_next(session, PriorityClass.LOW, offered=uuid.uuid4(), worker_id="w", lease_s=30, weights={})
            assert job is not None
            started.append(job.id)
    assert started == ids


def test_weights_give_turns_in_proportion(clean):
    queue(clean, "a", 20)
    queue(clean, "b", 20)
    order = claims(clean, 12, weights={"b": 3})
    assert order.count("b") == 9 and order.count("a") == 3


def test_an_idle_tenant_rejoins_at_the_clock_and_saves_no_turns(clean):
    queue(clean, "a", 30)
    queue(clean, "b", 2)
    claims(clean, 4)  # b's two ran; b is idle from here
    claims(clean, 10)  # a alone for ten turns
    queue(clean, "b", 10)
    order = claims(clean, 6)
    # b comes back level with a, not ten turns ahead: the two alternate.
    assert order in (["b", "a", "b", "a", "b", "a"], ["a", "b", "a", "b", "a", "b"])


def test_a_job_whose_message_is_not_out_is_only_claimed_through_its_own(clean):
    unsent = queue(clean, "c", 1, sent=False)[0]
    queue(clean, "a", 1)
    # Another job's message never takes it: the unsent job would be left running while the other lost its message.
    assert claims(clean, 2) == ["a"]
    assert claims(clean, 1, offered=unsent) == ["c"]


def test_a_cancelled_job_is_skipped_and_an_empty_class_claims_nothing(clean):
    a = queue(clean, "a", 2)
    with session_scope(clean) as session:
        session.execute(update(Job).where(Job.id == a[0]).values(cancel_requested=True))
    assert claims(clean, 3) == ["a"]
