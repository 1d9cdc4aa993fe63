"""Property-based requests generated from vidq's own OpenAPI schema against the real API process: nothing a
client can send produces a 5xx, and every response matches the documented schema."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

MAX_EXAMPLES = 25


def test_no_request_causes_a_server_error(api_url, tenant_key):
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json")
    auth = {"Authorization": f"Bearer {tenant_key['api_key']}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8

    for operation in operations:

        @given(case=operation.as_strategy())
        @hsettings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            case.headers = {**(case.headers or {}), **auth}
            response = case.call(timeout=30)
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} → {response.status_code}: {response.text[:500]}"
            )
            case.validate_response(
                response,
                checks=[schemathesis.checks.status_code_conformance, schemathesis.checks.response_schema_conformance],
            )

        check()
