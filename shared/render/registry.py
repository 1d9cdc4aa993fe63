"""The model registry: every diffusers pipeline vidq runs is built here, and kept warm once built.

Three kinds of model name (docs/architecture.md, "Rendering"):

* ``tiny-wan``: a real ``WanPipeline`` from tiny configs with seeded random weights. It renders noise, not
  video; it exists so tests, CI and the CPU demo run the real pipeline code end to end in well under a second.
* ``wan2.1-1.3b-arch``: the Wan2.1-T2V-1.3B architecture at full size with random weights. It renders noise
  too, but its compute and memory cost are the real model's, which is what benchmarks need.
* anything else: a local diffusers folder or a hub id, loaded with ``from_pretrained`` (offline-safe for a
  folder); ``local`` is the folder in ``settings.model_dir``.

Pipelines are expensive to build, so ``get_pipeline`` keeps one per ``PipelineKey`` (model, compute dtype, device,
precision tier, …) per process, built on first use. Settings reach this module as arguments, from the process's
entry point.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline  # the root re-exports a placeholder to mypy

from shared.render.architectures import TINY_WAN, WAN21_13B_ARCH, build_tiny_wan, build_wan21_13b_arch
from shared.render.pipeline import VideoPipeline
from shared.render.pool import PipelinePool, PoolPolicy
from shared.render.precision import dtype_from_name, dtype_name, resolve_device
from shared.render.text import LOCAL, encoder_identity
from shared.render.tiers import compiles, policy_for
from shared.spec import Precision

MEMORY_MODES = ("resident", "low_vram")

__all__ = ["LOCAL", "TINY_WAN", "WAN21_13B_ARCH", "PipelineKey", "build_pipeline", "get_pipeline", "pipeline_for"]


class RenderSettings(Protocol):
    """What the registry reads from a process's settings (``shared.infra.config.Settings`` has all of it)."""

    @property
    def device(self) -> str | None: ...  # "cuda", "cuda:1", "cpu"; None = CUDA if there is one

    @property
    def cuda_dtype(self) -> str: ...  # "bfloat16" or "float16"

    @property
    def model_dir(self) -> str | None: ...  # the folder served as model "local"

    @property
    def worker_text_encoder(self) -> str: ...  # "local": built with its text encoder; "remote": without

    @property
    def worker_memory_mode(self) -> str: ...  # "resident" or "low_vram"

    @property
    def worker_compile(self) -> str: ...  # "auto" (CUDA only), "on" or "off"

    @property
    def worker_low_vram_decode_budget_mb(self) -> int: ...  # cap of a low_vram decode's budget; 0: the free memory


@dataclass(frozen=True, slots=True)
class PipelineKey:
    """What tells two loaded pipelines apart: the cache (and, later, a VRAM pool) holds one per key."""

    model: str
    precision: str  # the compute dtype's name for now: "bfloat16", "float16" or "float32"
    device: str  # as torch prints it: "cpu", "cuda", "cuda:1"
    text_encoder: bool = True  # False: built without it (embeddings come from the cache or the prewarmer)
    memory_mode: str = "resident"  # or "low_vram": weights in CPU RAM, streamed to the GPU block by block
    tier: Precision = "exact"  # the precision tier it renders (shared/render/tiers.py)
    compile: bool = False  # its transformer blocks compiled

    def __post_init__(self) -> None:
        dtype_from_name(self.precision)  # a typo fails here, not minutes later in a build
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(f"unknown memory mode {self.memory_mode!r}; expected one of {MEMORY_MODES}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_name(self.precision)


class WholeModuleOffload:
    """Keeps a module's weights in pinned CPU memory and copies all of them to ``device`` for each forward call,
    dropping the GPU copies after it (tied weights are copied once)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.tensors = [*module.parameters(), *module.buffers()]
        self.pinned = [t.data.to("cpu").pin_memory() for t in self.tensors]
        for tensor, pinned in zip(self.tensors, self.pinned, strict=True):
            tensor.data = pinned
        module.register_forward_pre_hook(self._onload)
        module.register_forward_hook(self._offload)
        module.vidq_onload_device = device  # type: ignore[assignment]  # where its inputs must go (text.py)

    def _onload(self, *_: object) -> None:
        for tensor, pinned in zip(self.tensors, self.pinned, strict=True):
            tensor.data = pinned.to(self.device, non_blocking=True)

    def _offload(self, *_: object) -> None:
        for tensor, pinned in zip(self.tensors, self.pinned, strict=True):
            tensor.data = pinned


def pipeline_key(
    model: str,
    *,
    device_pref: str | None,
    cuda_dtype: str,
    text_encoder: bool = True,
    memory_mode: str = "resident",
    tier: Precision = "exact",
    compile_mode: str = "off",
) -> PipelineKey:
    """The key ``model`` runs under on this machine: ``settings.device`` and ``settings.cuda_dtype`` resolved;
    ``compile_mode`` is ``settings.worker_compile`` (shared/render/tiers.py ``compiles``)."""
    device, dtype = resolve_device(device_pref, cuda_dtype=cuda_dtype)
    return PipelineKey(
        model=model,
        precision=dtype_name(dtype),
        device=str(device),
        text_encoder=text_encoder,
        memory_mode=memory_mode,
        tier=tier,
        compile=compiles(compile_mode, device=device, memory_mode=memory_mode),
    )


def apply_memory_mode(pipe: DiffusionPipeline, mode: str, *, device: torch.device) -> None:
    """``low_vram``: the transformer lives in CPU RAM and is streamed to ``device`` one block at a time on a side
    CUDA stream (diffusers group offloading: the next block's copy overlaps this block's compute); the text encoder
    lives in pinned CPU RAM and is copied whole to the GPU for each encode (``WholeModuleOffload``: its peak never
    coincides with the transformer's). The VAE stays on ``device``; each decode then runs whole when that fits the free
    memory (at most ``worker_low_vram_decode_budget_mb``), in tiles when not (``VideoPipeline._decode``,
    shared/render/memory.py). ``resident`` (and any mode off CUDA): everything stays where it was built."""
    if mode == "resident" or device.type != "cuda":
        return
    from diffusers.hooks import apply_group_offloading

    transformer = getattr(pipe, "transformer", None)
    if transformer is not None:
        apply_group_offloading(
            transformer,
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
        )
    text_encoder = getattr(pipe, "text_encoder", None)
    if text_encoder is not None:
        # Block-level streaming of UMT5 measured 10 s per encode on an H200 (its blocks sit below a T5Stack, which
        # group offloading treats as one unmatched module): one pinned copy of the whole encoder is ~0.5 s.
        WholeModuleOffload(text_encoder, device)
    torch.cuda.empty_cache()


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


_pool = PipelinePool()  # this process's pipelines (shared/render/pool.py)


def get_pipeline(key: PipelineKey, *, model_dir: str | None = None, decode_budget_mb: int = 0) -> VideoPipeline:
    """The process-wide pipeline for ``key``: built on first use, then kept warm on its device while the VRAM pool's
    budget allows (one build per key even when two threads ask at once).

    ``model_dir`` is ``settings.model_dir``; only the model ``local`` reads it. ``decode_budget_mb`` is
    ``settings.worker_low_vram_decode_budget_mb``; only a low_vram pipeline on CUDA reads it.
    """

    def build() -> VideoPipeline:
        device, dtype = key.torch_device, key.dtype
        folder = model_dir if key.model == LOCAL else None  # any other name is its own source
        pipe = build_pipeline(key.model, device=device, dtype=dtype, model_dir=folder, text_encoder=key.text_encoder)
        apply_memory_mode(pipe, key.memory_mode, device=device)
        identity = encoder_identity(key.model, dtype=dtype, model_dir=folder)
        policy = policy_for(
            key.tier, device=device, compile_mode="on" if key.compile else "off", memory_mode=key.memory_mode
        )
        return VideoPipeline(
            pipe,
            model=key.model,
            device=device,
            dtype=dtype,
            identity=identity,
            memory_mode=key.memory_mode,
            policy=policy,
            decode_budget_mb=decode_budget_mb,
        )

    return _pool.get(key, build)


def pool_state() -> list[tuple[PipelineKey, str, int]]:
    """(key, "device" or "host", bytes) of this process's pipelines, most recently used first."""
    return _pool.state()


def pipeline_for(
    model: str, settings: RenderSettings, *, memory_mode: str | None = None, tier: Precision = "exact"
) -> VideoPipeline:
    """The process-wide pipeline for ``model`` under ``settings`` (device, CUDA dtype, model folder, memory mode and
    its decode budget, compile) in precision tier ``tier``; ``memory_mode`` overrides the worker's (a retry after
    running out of memory)."""
    mode = memory_mode or _downgraded.get(model) or settings.worker_memory_mode
    _pool.policy = PoolPolicy.from_settings(settings)
    key = pipeline_key(
        model,
        device_pref=settings.device,
        cuda_dtype=settings.cuda_dtype,
        text_encoder=settings.worker_text_encoder == "local",
        memory_mode=mode,
        tier=tier,
        compile_mode=settings.worker_compile,
    )
    return get_pipeline(key, model_dir=settings.model_dir, decode_budget_mb=settings.worker_low_vram_decode_budget_mb)


_downgraded: dict[str, str] = {}  # model → the memory mode this process falls back to after running out


def fall_back_to_low_vram(model: str, settings: RenderSettings, *, tier: Precision = "exact") -> VideoPipeline:
    """After a CUDA out-of-memory: drop this process's pipelines of ``model`` (their VRAM goes back), and serve
    ``model`` in ``low_vram`` from now on. Returns that pipeline."""
    _pool.drop(k for k in _pool.kept() if k.model == model)
    _downgraded[model] = "low_vram"
    return pipeline_for(model, settings, memory_mode="low_vram", tier=tier)


def clear_cache() -> None:
    """Drop every cached pipeline (tests; a worker that must free its GPU)."""
    _pool.drop(_pool.kept())
    _downgraded.clear()
