"""The Grafana dashboard only charts metrics vidq really exports (catches a renamed metric)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

import services.api.metrics  # noqa: F401  (registers the API metrics)
import services.api.pools  # noqa: F401  (the API's worker-pool metrics)
import services.prewarmer.service  # noqa: F401  (the prewarmer's metrics; imports torch)
import services.worker.metrics as worker_metrics
import shared.textcache.monitor  # noqa: F401  (the embedding cache's lookup counters)

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


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too; rows themselves chart nothing."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def series(panel: dict[str, Any]) -> set[str]:
    return {name for target in panel["targets"] for name in re.findall(r"\bvidq_[a-z_]+", target["expr"])}


def test_every_dashboard_series_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    used = set().union(*(series(p) for p in panels(dashboard)))
    assert used, "the dashboard charts nothing"
    exported = exported_names()
    # Histogram series (_bucket, _count, _sum) appear once observed; their base name is always registered.
    missing = {n for n in used if n not in exported and re.sub(r"_(bucket|count|sum)$", "", n) not in exported}
    assert not missing, f"dashboard uses metrics nobody exports: {sorted(missing)}"


def test_the_embedding_cache_row_charts_the_cache_and_the_prewarmer():
    dashboard = json.loads(DASHBOARD.read_text())
    top = dashboard["panels"]
    rows = [i for i, p in enumerate(top) if p["type"] == "row" and p["title"] == "Embedding cache"]
    assert len(rows) == 1, "one row titled 'Embedding cache'"
    start = rows[0]
    end = next((i for i in range(start + 1, len(top)) if top[i]["type"] == "row"), len(top))
    # An open row owns the panels after it; a collapsed one holds them itself.
    inside = top[start].get("panels") or top[start + 1 : end]
    charted = set().union(*(series(p) for p in inside))
    assert {
        "vidq_embedding_cache_hit_rate",
        "vidq_embedding_cache_lookups_total",
        "vidq_prewarmer_compensating",
        "vidq_prewarmer_mode_changes_total",
        "vidq_prewarmer_encoded_total",
        "vidq_prewarmer_requests_total",
    } <= charted
    # No two panels of the dashboard overlap on Grafana's grid.
    cells: dict[tuple[int, int], str] = {}
    for panel in top:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_worker_pools_row_puts_pools_side_by_side():
    dashboard = json.loads(DASHBOARD.read_text())
    top = dashboard["panels"]
    (start,) = [i for i, p in enumerate(top) if p["type"] == "row" and p["title"] == "Worker pools"]
    end = next((i for i in range(start + 1, len(top)) if top[i]["type"] == "row"), len(top))
    inside = top[start].get("panels") or top[start + 1 : end]
    charted = set().union(*(series(p) for p in inside))
    assert {
        "vidq_worker_jobs_total",
        "vidq_worker_failures_total",
        "vidq_worker_render_step_seconds_bucket",
        "vidq_worker_queue_wait_seconds_bucket",
        "vidq_api_pool_routed_total",
        "vidq_api_pool_fallbacks_total",
        "vidq_api_pool_state",
    } <= charted
    # Every panel of the row is split by pool.
    assert all("pool" in target["expr"] for p in inside for target in p["targets"])
