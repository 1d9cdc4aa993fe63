"""Engine and sessions. ``session_scope()`` is the one commit point for a unit of work; helpers only flush."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from shared.infra.config import Settings

_engines: dict[str, Engine] = {}


def make_engine(settings: Settings) -> Engine:
    # No pre-ping (a round trip per checkout): a connection found dead fails its one request with a 503, and
    # SQLAlchemy then invalidates the whole pool, so an outage costs one error per process, not one per connection.
    # sqlalchemy.create_engine is looked up at call time: tracing's instrumentation (shared/infra/tracing.py) wraps it.
    return sqlalchemy.create_engine(
        settings.sqlalchemy_url,
        pool_pre_ping=False,
        pool_size=settings.db_pool_size,
        max_overflow=5,  # room for background work beside admitted requests (sweeper, send records, streams)
        pool_timeout=settings.db_pool_timeout_s,
        pool_recycle=settings.db_pool_recycle_s,
        connect_args={
            "connect_timeout": settings.db_connect_timeout_s,
            "options": f"-c statement_timeout={settings.db_statement_timeout_ms}",
        },
    )


def get_engine(settings: Settings) -> Engine:
    """One engine per database URL per process (each process builds its own after fork)."""
    url = settings.sqlalchemy_url
    if url not in _engines:
        _engines[url] = make_engine(settings)
    return _engines[url]


def dispose_engines() -> None:
    for engine in _engines.values():
        engine.dispose()
    _engines.clear()


def session_factory(settings: Settings) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    session = session_factory(settings)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def db_unreachable(exc: BaseException) -> bool:
    """Postgres is down or unreachable (refused, reset, timed out, no pooled connection), not a bad statement."""
    if isinstance(exc, OperationalError | PoolTimeout):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)
