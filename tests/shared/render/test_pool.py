"""The VRAM pool with real tiny-wan pipelines on the CPU and a byte budget: least recently used or lowest priority
leaves first, to host memory while its budget allows (coming back is the same object, not a rebuild), else dropped."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shared.render.pipeline import VideoPipeline
from shared.render.pool import PipelinePool, PoolPolicy, device_bytes
from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.text import encoder_identity

CPU = torch.device("cpu")


class Builds:
    """Builds a tiny-wan pipeline per key and counts the builds."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def __call__(self, model: str) -> VideoPipeline:
        self.count[model] = self.count.get(model, 0) + 1
        pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
        identity = encoder_identity(TINY_WAN, dtype=torch.float32)  # the key's name is not a model name here
        return VideoPipeline(pipe, model=model, device=CPU, dtype=torch.float32, identity=identity)


@pytest.fixture(scope="module")
def size() -> int:
    return device_bytes(Builds()("probe"))


def where(pool: PipelinePool) -> dict[str, str]:
    return {key: location for key, location, _ in pool.state()}


def test_a_byte_budget_for_two_keeps_the_two_most_recently_used(size: int) -> None:
    builds = Builds()
    pool = PipelinePool(PoolPolicy(budget_bytes=2 * size, host_budget_bytes=10 * size))
    a = pool.get("a", lambda: builds("a"))
    pool.get("b", lambda: builds("b"))
    assert pool.get("a", lambda: builds("a")) is a  # a used again: b is now the least recent
    pool.get("c", lambda: builds("c"))
    assert where(pool) == {"c": "device", "a": "device", "b": "host"}
    assert pool.get("b", lambda: builds("b")) is not None
    assert builds.count == {"a": 1, "b": 1, "c": 1}  # b came back from host memory, not rebuilt
    assert where(pool) == {"b": "device", "c": "device", "a": "host"}


def test_priority_eviction_keeps_the_high_priority_model_however_old(size: int) -> None:
    builds = Builds()
    policy = PoolPolicy(max_models=2, eviction="priority", priorities={"vip": 10}, host_budget_bytes=10 * size)
    pool = PipelinePool(policy)
    pool.get("vip", lambda: builds("vip"))
    pool.get("b", lambda: builds("b"))
    pool.get("c", lambda: builds("c"))  # vip is the least recent, but b goes
    assert where(pool)["vip"] == "device" and where(pool)["b"] == "host"
    lru = PipelinePool(replace(policy, eviction="lru"))
    for model in ("vip", "b", "c"):
        lru.get(model, lambda model=model: builds(model))
    assert where(lru)["vip"] == "host"


def test_without_host_budget_an_evicted_pipeline_is_dropped_and_rebuilt_on_return(size: int) -> None:
    builds = Builds()
    pool = PipelinePool(PoolPolicy(max_models=1, host_budget_bytes=0))
    pool.get("a", lambda: builds("a"))
    pool.get("b", lambda: builds("b"))
    assert where(pool) == {"b": "device"}
    pool.get("a", lambda: builds("a"))
    assert builds.count == {"a": 2, "b": 1}


def test_no_budget_keeps_everything(size: int) -> None:
    builds = Builds()
    pool = PipelinePool()
    for model in ("a", "b", "c"):
        pool.get(model, lambda model=model: builds(model))
    assert set(where(pool).values()) == {"device"} and len(where(pool)) == 3
