"""Encoder-free workers: a worker asks the prewarmer for the embeddings no tier holds, and waits with a timeout.

A request is a JSON message LPUSHed to one list in the broker Redis; the prewarmer BLPOPs it (before any other
work of its cycle), encodes, writes L2/L3 as usual and RPUSHes the entries to the request's own reply list, which
the worker BLPOPs. No answer within ``timeout_s`` (the prewarmer is down, overloaded, or has not loaded the
model) is ``EmbeddingsUnavailable``: the job goes back to its queue for another attempt (a retryable error).
A request carries its deadline, so a prewarmer that comes back does not work on requests nobody waits for.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import asdict, dataclass

import redis
import torch

from shared.errors import EmbeddingsUnavailable
from shared.render.text import EncoderIdentity
from shared.textcache.codec import CorruptEntry, unpack


def requests_key(prefix: str) -> str:
    return f"{prefix}vidq:cache:encode:requests"


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    id: str
    model: str
    dtype: str
    fingerprint: str
    texts: list[str]
    reply_to: str
    deadline: float  # unix seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: bytes | str) -> EncodeRequest:
        return cls(**json.loads(raw))


class RemoteEncoder:
    """The worker's side. ``client`` must allow blocking calls of ``timeout_s`` (its socket timeout above it)."""

    def __init__(self, client: redis.Redis, *, prefix: str, timeout_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.timeout_s = timeout_s

    def encode(self, identity: EncoderIdentity, texts: list[str]) -> list[torch.Tensor]:
        request_id = uuid.uuid4().hex
        request = EncodeRequest(
            id=request_id,
            model=identity.model,
            dtype=identity.dtype,
            fingerprint=identity.fingerprint,
            texts=texts,
            reply_to=f"{self.prefix}vidq:cache:encode:reply:{request_id}",
            deadline=time.time() + self.timeout_s,
        )
        try:
            self.client.lpush(requests_key(self.prefix), request.to_json())
            answer = self.client.blpop([request.reply_to], timeout=self.timeout_s)
        except redis.RedisError as exc:
            raise EmbeddingsUnavailable(f"text encoder unreachable: {exc}") from exc
        if answer is None:
            raise EmbeddingsUnavailable(f"no prewarmer answered within {self.timeout_s:.0f} s")
        reply = json.loads(answer[1])
        if reply.get("error"):
            raise EmbeddingsUnavailable(f"prewarmer: {reply['error']}")
        try:
            return [
                unpack(base64.b64decode(entry), key=identity.key(text), identity=identity)
                for text, entry in zip(texts, reply["entries"], strict=True)
            ]
        except (CorruptEntry, KeyError, ValueError) as exc:
            raise EmbeddingsUnavailable(f"prewarmer answered with unusable embeddings: {exc}") from exc


def take_request(client: redis.Redis, *, prefix: str, timeout_s: float) -> EncodeRequest | None:
    """The prewarmer's side: the oldest request, waiting up to ``timeout_s`` for one (0 = do not wait)."""
    if timeout_s <= 0:
        raw = client.rpop(requests_key(prefix))
        return EncodeRequest.from_json(raw) if isinstance(raw, bytes | str) else None
    answer = client.brpop([requests_key(prefix)], timeout=timeout_s)
    return EncodeRequest.from_json(answer[1]) if answer else None


def reply(client: redis.Redis, request: EncodeRequest, *, entries: list[bytes] | None, error: str = "") -> None:
    body = {"entries": [base64.b64encode(e).decode() for e in entries or []], "error": error}
    pipe = client.pipeline(transaction=True)
    pipe.rpush(request.reply_to, json.dumps(body))
    pipe.expire(request.reply_to, 60)  # a worker that gave up never reads it
    pipe.execute()
