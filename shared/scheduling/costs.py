"""What a render costs, as the workers measured it: the basis of the ETA quotes (services/api/jobs/estimates.py).

After each job a worker records one sample for its model and shape (frames × height × width): its steps, the
seconds of its denoising loop, and the seconds of everything else that held the worker from the claim until its
video was stored (text encoding, VAE decode, MP4 encode, upload, the database). The last ``eta_samples`` of each
shape are kept in Redis (under the broker key prefix), so every API process quotes from the same, fresh
measurements of the fleet it serves.

A cost for ``steps`` steps is, over the samples, the median of ``fixed + denoise × steps / sample steps``: for the
steps the samples had, the median of the renders themselves. A shape nobody measured is costed from the nearest
measured shape of the same model (by frames × height × width), scaled by the ratio of the two; a model with no
sample at all has no cost, and its jobs get no quote.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from shared.infra.config import Settings
from shared.spec import GenerationSpec

Shape = tuple[str, int, int, int]  # model, frames, height, width


def shape_of(spec: GenerationSpec) -> Shape:
    return (spec.model, spec.num_frames, spec.height, spec.width)


def _key(shape: Shape) -> str:
    model, frames, height, width = shape
    return f"{model}|{frames}x{height}x{width}"


def _parse(key: str) -> Shape:
    model, _, dims = key.rpartition("|")
    frames, height, width = (int(d) for d in dims.split("x"))
    return (model, frames, height, width)


@dataclass(frozen=True, slots=True)
class Sample:
    steps: int
    denoise_s: float
    fixed_s: float

    def cost_s(self, steps: int) -> float:
        return self.fixed_s + self.denoise_s * steps / max(1, self.steps)


def _shapes_key(settings: Settings) -> str:
    return f"{settings.broker_key_prefix}vidq:eta:shapes"


def _samples_key(settings: Settings, shape: Shape) -> str:
    return f"{settings.broker_key_prefix}vidq:eta:samples:{_key(shape)}"


def record(client: redis.Redis, settings: Settings, spec: GenerationSpec, stages_s: Mapping[str, float]) -> None:
    """One job's sample, from its stage seconds: the pipeline's ``denoise`` and ``batch`` (the members it rendered
    with), and ``elapsed``, the seconds from its claim to its video stored (everything the worker spent on it:
    text, decode, encode, upload, the database; the job's timings show it as ``worker``). A batch's member is
    charged its share: ``elapsed`` and ``denoise`` over the batch size. Raises redis errors; the worker's caller
    ignores them."""
    batch = max(1.0, float(stages_s.get("batch", 1.0)))
    denoise = float(stages_s.get("denoise", 0.0)) / batch
    fixed = float(stages_s.get("elapsed", stages_s.get("total", 0.0))) / batch - denoise
    shape = shape_of(spec)
    sample = json.dumps({"steps": spec.steps, "denoise_s": round(denoise, 4), "fixed_s": round(max(0.0, fixed), 4)})
    key = _samples_key(settings, shape)
    pipe = client.pipeline(transaction=True)
    pipe.sadd(_shapes_key(settings), _key(shape))
    pipe.lpush(key, sample)
    pipe.ltrim(key, 0, settings.eta_samples - 1)
    pipe.execute()


def load(client: redis.Redis, settings: Settings) -> CostModel:
    """Every shape's samples, in two round trips."""
    keys = sorted(k.decode() if isinstance(k, bytes) else str(k) for k in client.smembers(_shapes_key(settings)))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.lrange(_samples_key(settings, _parse(key)), 0, -1)
    samples: dict[Shape, list[Sample]] = {}
    for key, raw in zip(keys, pipe.execute(), strict=True):
        parsed = [Sample(**json.loads(item)) for item in raw]
        if parsed:
            samples[_parse(key)] = parsed
    return CostModel(samples)


class CostModel:
    def __init__(self, samples: Mapping[Shape, Iterable[Sample]]) -> None:
        self._samples = {shape: list(s) for shape, s in samples.items() if s}

    def cost_s(self, spec: GenerationSpec) -> float | None:
        """Seconds a worker is expected to spend on ``spec``; None when its model was never measured."""
        return self.cost_of(spec.model, spec.num_frames, spec.height, spec.width, spec.steps)

    def cost_of_stored(self, spec: Mapping[str, Any]) -> float | None:
        """``cost_s`` of a job's stored spec (``jobs.spec``), read for its shape and steps alone."""
        return self.cost_of(
            str(spec["model"]), int(spec["num_frames"]), int(spec["height"]), int(spec["width"]), int(spec["steps"])
        )

    def cost_of(self, model: str, frames: int, height: int, width: int, steps: int) -> float | None:
        """``cost_s`` from a job's shape and steps alone."""
        shape = (model, frames, height, width)
        if shape in self._samples:
            return statistics.median(s.cost_s(steps) for s in self._samples[shape])
        nearest = self._nearest(shape)
        if nearest is None:
            return None
        scale = _volume(shape) / _volume(nearest)
        return scale * statistics.median(s.cost_s(steps) for s in self._samples[nearest])

    def _nearest(self, shape: Shape) -> Shape | None:
        same_model = [s for s in self._samples if s[0] == shape[0]]
        if not same_model:
            return None
        return min(same_model, key=lambda s: abs(_volume(s) - _volume(shape)))

    def __bool__(self) -> bool:
        return bool(self._samples)


def _volume(shape: Shape) -> int:
    _, frames, height, width = shape
    return max(1, frames * height * width)
