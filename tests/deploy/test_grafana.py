"""The Grafana dashboard only charts metrics vidq really exports (catches a renamed metric)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import services.api.metrics  # noqa: F401  (registers the API metrics)
import services.worker.metrics as worker_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "vidq-dashboard.json"


def exported_names() -> set[str]:
    names: set[str] = set(worker_metrics.GPU_METRICS)
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            names.add(sample.name)
        names.add(metric.name)
        if metric.type == "counter":  # exposed with the _total suffix
            names.add(f"{metric.name}_total")
    return names


def test_every_dashboard_series_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bvidq_[a-z_]+", target["expr"])
    }
    assert used, "the dashboard charts nothing"
    exported = exported_names()
    # Histogram series (_bucket, _count, _sum) appear once observed; their base name is always registered.
    missing = {n for n in used if n not in exported and re.sub(r"_(bucket|count|sum)$", "", n) not in exported}
    assert not missing, f"dashboard uses metrics nobody exports: {sorted(missing)}"
