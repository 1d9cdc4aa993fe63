"""Request dependencies: settings, the per-request session (the one commit point), the caller's tenant.

The tenant behind an API key is remembered per process for ``VIDQ_API_KEY_CACHE_S`` (a revoked key keeps working
at most that long), so most requests spend no database round trip on authentication."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from shared.errors import Unauthorized
from shared.infra.config import Settings
from shared.infra.db import session_scope
from shared.tenants import hash_key, tenant_for_key_hash


async def get_settings_dep(request: Request) -> Settings:  # async: no I/O, so no thread-pool hop
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with session_scope(request.app.state.settings) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


# auto_error=False: a missing or malformed header gets vidq's own 401 body, not FastAPI's default error.
bearer = HTTPBearer(auto_error=False, description="an API key from `vidq create-key`")


@dataclass(frozen=True, slots=True)
class Caller:
    """The tenant an API key belongs to (detached from any session)."""

    id: uuid.UUID
    name: str


class KeyCache:
    """key hash → (caller, expiry). Only found keys are kept: a flood of wrong keys cannot fill it."""

    def __init__(self, *, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: dict[str, tuple[Caller, float]] = {}

    def get(self, key_hash: str) -> Caller | None:
        hit = self._entries.get(key_hash)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def knows(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header's bearer key is one this process found valid recently."""
        scheme, _, key = authorization.partition(" ")
        return scheme.lower() == "bearer" and bool(key.strip()) and self.get(hash_key(key.strip())) is not None

    def put(self, key_hash: str, caller: Caller) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()  # rare; simpler than LRU and bounded all the same
        self._entries[key_hash] = (caller, time.monotonic() + self.ttl_s)


async def get_tenant(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Caller:
    """Async so that a cached key costs no thread-pool hop; a miss looks the key up in a session of its own, in
    the thread pool, and never holds the request's connection."""
    if credentials is None or not credentials.credentials.strip():
        raise Unauthorized("send an API key as 'Authorization: Bearer <key>'")
    key_hash = hash_key(credentials.credentials.strip())
    cache: KeyCache = request.app.state.key_cache
    caller = cache.get(key_hash)
    if caller is None:
        caller = await run_in_threadpool(_lookup, request.app.state.settings, key_hash)
        if caller is None:
            raise Unauthorized("invalid or revoked API key")
        cache.put(key_hash, caller)
    return caller


def _lookup(settings: Settings, key_hash: str) -> Caller | None:
    with session_scope(settings) as session:
        tenant = tenant_for_key_hash(session, key_hash)
        return None if tenant is None else Caller(id=tenant.id, name=tenant.name)


TenantDep = Annotated[Caller, Depends(get_tenant)]


# A submit's choice of worker pool (shared/pools/rules.py): both submit endpoints take it.
PoolHeader = Annotated[
    str | None,
    Header(
        alias="X-Vidq-Pool",
        description="the worker pool to render in; only for tenants an operator allowed to choose (else 403)",
    ),
]
