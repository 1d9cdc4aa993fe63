"""Tenants and API keys. Keys are shown once and stored as sha256 (they are 256-bit random, so a fast hash is
enough and lookups stay O(1))."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.models import ApiKey, Tenant
from shared.webhooks.signing import new_secret

KEY_PREFIX = "vidq_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedKey:
    tenant_id: str
    tenant_name: str
    api_key: str
    webhook_secret: str


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    tenant = session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()
    if tenant is None:
        tenant = Tenant(name=name, webhook_secret=new_secret())
        session.add(tenant)
        session.flush()
    return tenant


def issue_key(session: Session, *, tenant_name: str, key_name: str = "") -> IssuedKey:
    tenant = get_or_create_tenant(session, tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(tenant_id=tenant.id, prefix=key[:12], key_hash=hash_key(key), name=key_name))
    session.flush()
    return IssuedKey(str(tenant.id), tenant.name, key, tenant.webhook_secret)


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    return tenant_for_key_hash(session, hash_key(key))


def tenant_for_key_hash(session: Session, key_hash: str) -> Tenant | None:
    return session.execute(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
