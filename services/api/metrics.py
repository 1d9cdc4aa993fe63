"""API metrics (Prometheus)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUEST_SECONDS = Histogram("vidq_api_request_seconds", "API request latency", ["method", "route", "status"])
SUBMITS = Counter("vidq_api_submits_total", "Jobs accepted, by priority class", ["priority_class"])
ERRORS = Counter("vidq_api_errors_total", "Error responses, by stable code and HTTP status", ["code", "status"])
