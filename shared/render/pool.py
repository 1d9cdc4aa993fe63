"""The VRAM pool: the pipelines a worker process keeps, within a budget of device memory.

A worker that serves several models (or one model in several keys: precision, memory mode, with or without its
text encoder) keeps each pipeline it built. With a budget (``vram_pool_budget_mb``) or a count
(``vram_pool_max_models``), making room evicts others: least recently used first (``lru``) or lowest priority first
(``priority``, ``vram_pool_priorities``; ties by least recent use). An evicted ``resident`` pipeline moves to CPU RAM
while the host budget (``vram_pool_host_budget_mb``) allows, so coming back costs a copy (seconds), not a rebuild;
otherwise, or past that budget, it is dropped. A pipeline's size is what its modules hold on its own device (a
``low_vram`` pipeline's streamed weights live in CPU RAM and do not count).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from prometheus_client import Counter, Gauge

from shared.render.pipeline import VideoPipeline

MIB = 1024 * 1024
POOL_MODELS = Gauge("vidq_vram_pool_models", "Pipelines kept by the VRAM pool, by where", ["location"])
POOL_BYTES = Gauge("vidq_vram_pool_bytes", "Bytes of the pipelines kept by the VRAM pool, by where", ["location"])
POOL_EVICTIONS = Counter("vidq_vram_pool_evictions", "Pipelines evicted from the device, by where to", ["to"])
POOL_LOADS = Counter("vidq_vram_pool_loads", "Pipelines made resident, by how (build, from_host)", ["how"])


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    budget_bytes: int = 0  # device bytes; 0 = no budget
    max_models: int = 0  # pipelines on the device; 0 = no limit
    eviction: Literal["lru", "priority"] = "lru"
    priorities: Mapping[str, int] = field(default_factory=dict)  # model → priority (higher stays longer; default 0)
    host_budget_bytes: int = 0  # CPU RAM for evicted pipelines; 0 = drop them

    @classmethod
    def from_settings(cls, settings: Any) -> PoolPolicy:
        return cls(
            budget_bytes=int(getattr(settings, "vram_pool_budget_mb", 0)) * MIB,
            max_models=int(getattr(settings, "vram_pool_max_models", 0)),
            eviction=getattr(settings, "vram_pool_eviction", "lru"),
            priorities=dict(getattr(settings, "vram_pool_priorities", {}) or {}),
            host_budget_bytes=int(getattr(settings, "vram_pool_host_budget_mb", 0)) * MIB,
        )


def device_bytes(pipeline: VideoPipeline) -> int:
    """Bytes of the pipeline's weights and buffers on its own device."""
    total = 0
    for name in ("transformer", "text_encoder", "vae"):
        module = getattr(pipeline.pipe, name, None)
        if isinstance(module, torch.nn.Module):
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.device.type == pipeline.device.type:
                    total += tensor.numel() * tensor.element_size()
    return total


@dataclass(slots=True)
class _Entry:
    pipeline: VideoPipeline
    size: int
    used: int  # a use counter: larger = more recent
    location: Literal["device", "host"] = "device"


class PipelinePool:
    def __init__(self, policy: PoolPolicy | None = None) -> None:
        self.policy = policy or PoolPolicy()
        self._entries: dict[Any, _Entry] = {}
        self._lock = threading.RLock()  # one build at a time, and no eviction races a use
        self._clock = 0

    def get(self, key: Any, build: Callable[[], VideoPipeline]) -> VideoPipeline:
        """The pipeline of ``key`` on its device: kept, brought back from CPU RAM, or built (``build()``)."""
        with self._lock:
            self._clock += 1
            entry = self._entries.get(key)
            if entry is not None and entry.location == "device":
                entry.used = self._clock
                return entry.pipeline
            if entry is not None:  # in CPU RAM: make room, then copy it back
                self._make_room(keep=key, extra=entry.size, adding=True)
                entry.pipeline.pipe.to(entry.pipeline.device)
                entry.location, entry.used = "device", self._clock
                POOL_LOADS.labels("from_host").inc()
                self._publish()
                return entry.pipeline
            self._make_room(keep=key, extra=0, adding=True)  # the count limit; the budget once its size is known
            pipeline = build()
            self._entries[key] = _Entry(pipeline, device_bytes(pipeline), self._clock)
            POOL_LOADS.labels("build").inc()
            self._make_room(keep=key, extra=0, adding=False)
            self._publish()
            return pipeline

    def state(self) -> list[tuple[Any, str, int]]:
        """(key, location, bytes) of every pipeline kept, most recently used first."""
        with self._lock:
            ordered = sorted(self._entries.items(), key=lambda kv: -kv[1].used)
            return [(k, e.location, e.size) for k, e in ordered]

    def drop(self, keys: Iterable[Any]) -> None:
        with self._lock:
            for key in list(keys):
                self._entries.pop(key, None)
            self._publish()
        _release_device_memory()

    def kept(self) -> list[Any]:
        with self._lock:
            return list(self._entries)

    # --- eviction ----------------------------------------------------------------------------------------------

    def _on_device(self) -> list[tuple[Any, _Entry]]:
        return [(k, e) for k, e in self._entries.items() if e.location == "device"]

    def _make_room(self, *, keep: Any, extra: int, adding: bool) -> None:
        p = self.policy
        while True:
            resident = [(k, e) for k, e in self._on_device() if k != keep]
            over_count = p.max_models and len(resident) + 1 > p.max_models
            used = sum(e.size for _, e in self._on_device()) + extra
            over_budget = p.budget_bytes and used > p.budget_bytes
            if not (over_count or over_budget) or not resident:
                return
            self._evict(*min(resident, key=self._eviction_rank))

    def _eviction_rank(self, item: tuple[Any, _Entry]) -> tuple[int, int]:
        key, entry = item
        if self.policy.eviction == "priority":
            return self.policy.priorities.get(entry.pipeline.model, 0), entry.used
        return 0, entry.used

    def _evict(self, key: Any, entry: _Entry) -> None:
        host_used = sum(e.size for e in self._entries.values() if e.location == "host")
        movable = entry.pipeline.memory_mode == "resident"  # group-offloaded modules cannot simply be moved
        if movable and host_used + entry.size <= self.policy.host_budget_bytes:
            entry.pipeline.pipe.to("cpu")
            entry.location = "host"
            POOL_EVICTIONS.labels("host").inc()
        else:
            del self._entries[key]
            POOL_EVICTIONS.labels("drop").inc()
        _release_device_memory()

    def _publish(self) -> None:
        for location in ("device", "host"):
            kept = [e for e in self._entries.values() if e.location == location]
            POOL_MODELS.labels(location).set(len(kept))
            POOL_BYTES.labels(location).set(sum(e.size for e in kept))


def _release_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
