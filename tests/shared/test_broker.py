"""Batched publishing writes what kombu writes: the same envelope, headers and body for the same task."""

from __future__ import annotations

import base64
import json
import uuid

import redis

from shared.messaging.broker import TaskMessage, decode, envelope, job_id_of, publisher
from shared.messaging.celery_app import make_celery
from shared.queues import TASK_GENERATE, Queue


def test_envelope_matches_what_celery_send_task_writes(settings, clean_state):
    celery = make_celery(settings)
    job_id = uuid.uuid4()
    key = f"{settings.broker_key_prefix}{Queue.HIGH.value}"
    client = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)

    celery.send_task(TASK_GENERATE, args=[str(job_id)], queue=Queue.HIGH.value)
    theirs = decode(client.lpop(key))
    publisher(celery).publish([TaskMessage(TASK_GENERATE, job_id, Queue.HIGH.value)])
    ours = decode(client.lpop(key))

    assert ours.keys() == theirs.keys()
    assert (
        ours["body"]
        == theirs["body"]
        == [[str(job_id)], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    )
    assert ours["headers"].keys() == theirs["headers"].keys()
    for field in ("task", "argsrepr", "kwargsrepr", "retries", "timelimit", "lang", "origin"):
        assert ours["headers"][field] == theirs["headers"][field], field
    assert ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]
    assert set(ours["properties"]) >= set(theirs["properties"]) - {"reply_to"}
    for field in ("delivery_mode", "delivery_info", "priority", "body_encoding"):
        assert ours["properties"][field] == theirs["properties"][field], field
    assert (ours["content-type"], ours["content-encoding"]) == (theirs["content-type"], theirs["content-encoding"])


def test_one_round_trip_for_a_batch_in_order(settings, clean_state):
    celery = make_celery(settings)
    ids = [uuid.uuid4() for _ in range(5)]
    publisher(celery).publish([TaskMessage(TASK_GENERATE, i, Queue.LOW.value) for i in ids])
    client = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)
    raw = client.lrange(f"{settings.broker_key_prefix}{Queue.LOW.value}", 0, -1)
    # LPUSH + BRPOP: the first pushed is the first consumed (the right end of the list).
    assert [decode(m)["body"][0][0] for m in reversed(raw)] == [str(i) for i in ids]


def test_the_job_id_is_read_back_from_kombus_messages_and_ours(settings, clean_state):
    celery = make_celery(settings)
    key = f"{settings.broker_key_prefix}{Queue.MEDIUM.value}"
    client = redis.Redis.from_url(str(settings.broker_url), socket_timeout=5)
    theirs, ours = uuid.uuid4(), uuid.uuid4()
    celery.send_task(TASK_GENERATE, args=[str(theirs)], queue=Queue.MEDIUM.value)
    publisher(celery).publish([TaskMessage(TASK_GENERATE, ours, Queue.MEDIUM.value)])
    assert [job_id_of(m) for m in reversed(client.lrange(key, 0, -1))] == [theirs, ours]
    # Anything else on the list is skipped, never an error: not JSON, not base64, another task's arguments.
    assert job_id_of(b"not json") is None
    assert job_id_of(b'{"body": "%%%"}') is None
    other = decode(envelope(celery, TaskMessage(TASK_GENERATE, ours, Queue.MEDIUM.value), origin="test"))
    other["body"][0] = []
    body = base64.b64encode(json.dumps(other["body"]).encode()).decode()
    assert job_id_of(json.dumps({**other, "body": body})) is None
