"""shared/models.py against the schema the migrations build (the session database, migrated by tests/conftest.py):
the models declare the same indexes and columns. Marked integration through ``settings``."""

from __future__ import annotations

from shared.infra.db import get_engine


def test_the_models_indexes_are_the_migrations(settings):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from shared.models import Base

    with get_engine(settings).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert [d for d in diff if "index" in str(d[0]) or "column" in str(d[0])] == []
