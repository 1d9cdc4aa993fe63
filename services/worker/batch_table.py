"""Where batching pays: the largest batch each shape renders in, as measured on this kind of device.

``benchmarks/batching.py`` renders each shape at batch 1, 2, 4, 8 on the device the workers run on and writes
JSON; ``VIDQ_WORKER_BATCH_TABLE`` points a worker at it. A shape batches up to the largest size whose videos per
second gained at least the benchmark's threshold over batch 1; elsewhere it renders alone, so batching never costs a
shape speed. A shape the table does not name follows the smallest measured shape of its model that is at least as
large (frames × height × width); one larger than any measured, or of another model, renders alone. Without a
table, every job renders alone.

    {"device": "...", "gain": 1.3,
     "shapes": [{"model": "tiny-wan", "frames": 9, "height": 64, "width": 64, "max_batch": 8}, ...]}
"""

from __future__ import annotations

import json
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


@lru_cache(maxsize=4)
def load(path: str) -> BatchTable:
    """The table at ``path`` (read once per process); an empty path: no batching."""
    if not path:
        return BatchTable([])
    return BatchTable.from_json(json.loads(Path(path).read_text()))
