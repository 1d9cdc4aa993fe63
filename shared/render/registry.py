"""The model registry: every diffusers pipeline vidq runs is built here, and kept warm once built.

Three kinds of model name (docs: DESIGN.md section 4, "Models without the internet"):

* ``tiny-wan``: a real ``WanPipeline`` from tiny configs with seeded random weights. It renders noise, not
  video; it exists so tests, CI and the CPU demo run the real pipeline code end to end in well under a second.
* ``wan2.1-1.3b-arch``: the Wan2.1-T2V-1.3B architecture at full size with random weights. It renders noise
  too, but its compute and memory cost are the real model's, which is what benchmarks need.
* anything else: a local diffusers folder or a hub id, loaded with ``from_pretrained`` (offline-safe for a
  folder); ``local`` is the folder in ``settings.model_dir``.

Pipelines are expensive to build, so ``get_pipeline`` keeps one per ``PipelineKey`` (model, precision, device)
per process, built on first use. Settings reach this module as arguments, from the process's entry point.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline  # the root re-exports a placeholder to mypy

from shared.render.architectures import TINY_WAN, WAN21_13B_ARCH, build_tiny_wan, build_wan21_13b_arch
from shared.render.pipeline import VideoPipeline
from shared.render.precision import dtype_from_name, dtype_name, resolve_device
from shared.render.text import LOCAL, encoder_identity

__all__ = ["LOCAL", "TINY_WAN", "WAN21_13B_ARCH", "PipelineKey", "build_pipeline", "get_pipeline", "pipeline_for"]


class RenderSettings(Protocol):
    """What the registry reads from a process's settings (``shared.config.Settings`` has all of it)."""

    @property
    def device(self) -> str | None: ...  # "cuda", "cuda:1", "cpu"; None = CUDA if there is one

    @property
    def cuda_dtype(self) -> str: ...  # "bfloat16" or "float16"

    @property
    def model_dir(self) -> str | None: ...  # the folder served as model "local"

    @property
    def worker_text_encoder(self) -> str: ...  # "local": built with its text encoder; "remote": without


@dataclass(frozen=True, slots=True)
class PipelineKey:
    """What tells two loaded pipelines apart: the cache (and, later, a VRAM pool) holds one per key."""

    model: str
    precision: str  # the compute dtype's name for now: "bfloat16", "float16" or "float32"
    device: str  # as torch prints it: "cpu", "cuda", "cuda:1"
    text_encoder: bool = True  # False: built without it (embeddings come from the cache or the prewarmer)

    def __post_init__(self) -> None:
        dtype_from_name(self.precision)  # a typo fails here, not minutes later in a build

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.precision)


def pipeline_key(model: str, *, device_pref: str | None, cuda_dtype: str, text_encoder: bool = True) -> PipelineKey:
    """The key ``model`` runs under on this machine: ``settings.device`` and ``settings.cuda_dtype`` resolved."""
    device, dtype = resolve_device(device_pref, cuda_dtype=cuda_dtype)
    return PipelineKey(model=model, precision=dtype_name(dtype), device=str(device), text_encoder=text_encoder)


def build_pipeline(
    model: str, *, device: torch.device, dtype: torch.dtype, model_dir: str | None = None, text_encoder: bool = True
) -> DiffusionPipeline:
    """Build the diffusers pipeline for ``model`` on ``device``: transformer and text encoder in ``dtype``;
    ``text_encoder=False`` leaves the encoder out (it is then never loaded, on any device).

    The VAE stays in float32 in every case, as Wan's reference code and diffusers' Wan examples run it;
    decoding is a small share of a render's time.
    """
    if model == TINY_WAN:
        return build_tiny_wan(device=device, dtype=dtype, text_encoder=text_encoder)
    if model == WAN21_13B_ARCH:
        return build_wan21_13b_arch(device=device, dtype=dtype, text_encoder=text_encoder)
    if model == LOCAL and not model_dir:
        raise ValueError("model 'local' needs settings.model_dir (VIDQ_MODEL_DIR)")
    source = model_dir or model
    # A folder never touches the network; a hub id resolves from the local cache when HF_HUB_OFFLINE is set.
    pipe = DiffusionPipeline.from_pretrained(
        source,
        dtype={"default": dtype, "vae": torch.float32},
        local_files_only=Path(source).is_dir(),
        **({} if text_encoder else {"text_encoder": None}),  # a None component is not loaded
    )
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)  # progress goes through on_step
    return pipe


_cache: dict[PipelineKey, VideoPipeline] = {}
_cache_lock = threading.Lock()


def get_pipeline(key: PipelineKey, *, model_dir: str | None = None) -> VideoPipeline:
    """The process-wide pipeline for ``key``, built on first use and then kept warm on its device.

    ``model_dir`` is ``settings.model_dir``; only the model ``local`` reads it.
    """
    with _cache_lock:  # one build per key even when two threads ask at once
        if key not in _cache:
            device, dtype = key.torch_device, key.dtype
            folder = model_dir if key.model == LOCAL else None  # any other name is its own source
            pipe = build_pipeline(
                key.model, device=device, dtype=dtype, model_dir=folder, text_encoder=key.text_encoder
            )
            identity = encoder_identity(key.model, dtype=dtype, model_dir=folder)
            _cache[key] = VideoPipeline(pipe, model=key.model, device=device, dtype=dtype, identity=identity)
        return _cache[key]


def pipeline_for(model: str, settings: RenderSettings) -> VideoPipeline:
    """The process-wide pipeline for ``model`` under ``settings`` (device, CUDA dtype, model folder)."""
    key = pipeline_key(
        model,
        device_pref=settings.device,
        cuda_dtype=settings.cuda_dtype,
        text_encoder=settings.worker_text_encoder == "local",
    )
    return get_pipeline(key, model_dir=settings.model_dir)


def clear_cache() -> None:
    """Drop every cached pipeline (tests; a worker that must free its GPU)."""
    with _cache_lock:
        _cache.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
