"""What the services' tests share: the query-plan tests' filled database, made once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services.query_plans import FilledDatabase, filled_database


@pytest.fixture(scope="session")
def filled(stack_env: dict[str, str]) -> Iterator[FilledDatabase]:
    """A database of its own holding 200,000 jobs, shared by the API's and the sweeper's query-plan tests. Apart
    from the session's database, so that ``clean_state`` elsewhere leaves it whole and it is filled only once."""
    yield from filled_database(stack_env["VIDQ_DATABASE_URL"])
