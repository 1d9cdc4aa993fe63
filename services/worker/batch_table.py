"""Where batching pays: the largest batch each shape renders in, as measured on this kind of device.

``benchmarks/batching.py`` renders each shape at batch 1, 2, 4, 8 on the device the workers run on and writes
JSON; ``VIDQ_WORKER_BATCH_TABLE`` points a worker at it. A shape batches up to the largest size whose videos per
second gained at least the benchmark's threshold over batch 1; elsewhere it renders alone, so batching never costs a
shape speed. A shape the table does not name follows the smallest measured shape of its model that is at least as
large (frames × height × width); one larger than any measured, or of another model, renders alone. Without a
table, every job renders alone.

``VIDQ_WORKER_BATCH_TABLE=auto`` (the default) is the table vidq ships for the worker's GPU, in
``services/worker/batch_tables/<gpu>.json`` (``nvidia-h200.json``: the GPU's name, lower case, dashes): measured
there, used there. On the CPU, and on a GPU with no table shipped, every job renders alone.

    {"device": "...", "gain": 1.3,
     "shapes": [{"model": "tiny-wan", "frames": 9, "height": 64, "width": 64, "max_batch": 8}, ...]}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from shared.spec import GenerationSpec


@dataclass(frozen=True, slots=True)
class Entry:
    model: str
    volume: int  # frames × height × width
    max_batch: int


class BatchTable:
    def __init__(self, entries: list[Entry]) -> None:
        self._entries = sorted(entries, key=lambda e: (e.model, e.volume))

    @classmethod
    def from_json(cls, data: dict[str, object]) -> BatchTable:
        shapes = data.get("shapes", [])
        if not isinstance(shapes, list):
            raise ValueError("a batch table's 'shapes' is a list")
        return cls(
            [
                Entry(
                    str(s["model"]), int(s["frames"]) * int(s["height"]) * int(s["width"]), max(1, int(s["max_batch"]))
                )
                for s in shapes
            ]
        )

    def max_batch(self, spec: GenerationSpec) -> int:
        volume = spec.num_frames * spec.height * spec.width
        for entry in self._entries:
            if entry.model == spec.model and entry.volume >= volume:
                return entry.max_batch
        return 1


SHIPPED = Path(__file__).with_name("batch_tables")
AUTO = "auto"


@lru_cache(maxsize=4)
def load(path: str, device: str | None = None) -> BatchTable:
    """The table at ``path`` (read once per process); ``auto``: the one shipped for the GPU this process renders on
    (``device``: the worker's VIDQ_DEVICE, None = CUDA where there is one); an empty path: no batching."""
    if path == AUTO:
        path = shipped_table(device) or ""
    if not path:
        return BatchTable([])
    return BatchTable.from_json(json.loads(Path(path).read_text()))


def gpu_slug(name: str) -> str:
    """A GPU's name as its table's file is named: "NVIDIA H200" → "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shipped_table(device: str | None) -> str | None:
    """The path of the table shipped for the GPU this process renders on, if there is one (None on the CPU). Only
    called where jobs render (the pool process), which has initialised CUDA already."""
    import torch

    if (device is not None and not device.startswith("cuda")) or not torch.cuda.is_available():
        return None
    path = SHIPPED / f"{gpu_slug(torch.cuda.get_device_name(device))}.json"
    return str(path) if path.exists() else None
