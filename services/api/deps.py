"""Request dependencies: settings, the per-request session (the one commit point), the caller's tenant."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from shared.config import Settings
from shared.db import session_scope
from shared.errors import Unauthorized
from shared.models import Tenant
from shared.tenants import tenant_for_key


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with session_scope(request.app.state.settings) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


# auto_error=False: a missing or malformed header gets vidq's own 401 body, not FastAPI's default error.
bearer = HTTPBearer(auto_error=False, description="an API key from `vidq create-key`")


def get_tenant(
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Tenant:
    if credentials is None or not credentials.credentials.strip():
        raise Unauthorized("send an API key as 'Authorization: Bearer <key>'")
    tenant = tenant_for_key(session, credentials.credentials.strip())
    if tenant is None:
        raise Unauthorized("invalid or revoked API key")
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]


def get_tenant_briefly(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Tenant:
    """``get_tenant`` in a session of its own, closed before the route runs: for a response that stays open (a
    progress stream), which must not hold a database connection for its whole life."""
    with session_scope(request.app.state.settings) as session:
        return get_tenant(session, credentials)


BriefTenantDep = Annotated[Tenant, Depends(get_tenant_briefly)]
