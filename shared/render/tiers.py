"""Precision tiers: how a job's video is computed, one table per tier, and what a render says about it.

A job names a tier (``precision`` on the request; the worker's ``VIDQ_WORKER_PRECISION`` when it names none):

* ``exact`` — the model's own math in bf16 (float32 on the CPU), with the fastest kernels that keep it: the
  transformer's repeated blocks compiled (fused elementwise work around cuBLAS GEMMs and SDPA's attention), the
  query/key/value projections as one GEMM, the conditional and unconditional passes of classifier-free guidance
  as one batch of two, attention on FlashAttention 4 where it runs and otherwise on SDPA's backend chosen by
  preference (shared/render/attention.py; the kernel that ran is recorded), the VAE decoding in bf16 with its
  decoder compiled. None of it changes what is computed, only how; the rounding differs from a plain eager call by
  the amounts the GPU benchmark records (PSNR of frames, largest latent difference).
* ``fast`` — accepted today and rendered as ``exact``; the job's result says so.

``TierPolicy`` holds the levers; ``MODULE_TABLE`` says, per weight of a Wan pipeline, which number format its
weights and compute use under a tier (first matching pattern wins). A render's result names the tier that ran, the
levers, the table and the attention kernel (``RenderedPrecision``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

import torch

from shared.render.attention import FLASH_ATTENTION_4, SDPA_PREFERENCE
from shared.spec import PRECISIONS, Precision

# The tiers this build renders; a requested tier not in here renders as the first one, and the result says so.
BUILT: tuple[Precision, ...] = ("exact",)

# Per weight (its dotted name in the pipeline, glob patterns, first match wins): the number format under each tier.
# "compute" is the tier's compute dtype (bf16 on CUDA, float32 on the CPU); "fp32" is kept in float32 whatever the
# tier, as the model's own code asks (its norms, rotary tables and timestep embedding; compiled, they fuse into the
# bf16 kernels around them and cost no extra memory traffic).
MODULE_TABLE: dict[Precision, tuple[tuple[str, str], ...]] = {
    "exact": (
        ("transformer.rope.*", "fp32"),
        ("transformer.condition_embedder.time_embedder.*", "fp32"),
        ("transformer.scale_shift_table", "fp32"),
        ("transformer.blocks.*.scale_shift_table", "fp32"),
        ("transformer.blocks.*.norm[123].*", "fp32"),
        ("transformer.*", "compute"),
        ("text_encoder.*", "compute"),
        ("vae.*", "vae"),
    ),
}

# Attention kernels in order of preference: the first that can run on the device, the call's shape and dtype is used
# (shared/render/attention.py). The SDPA names are SDPA's own backends.
ATTENTION_PREFERENCE = (FLASH_ATTENTION_4, *SDPA_PREFERENCE)


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """The levers of a tier on one device. Each one keeps the math; each can be switched off (benchmarks, tests)."""

    name: Precision
    compile_blocks: bool  # torch.compile each transformer block (fullgraph, static shapes)
    fused_qkv: bool  # one GEMM for the self-attention's q/k/v (and the cross-attention's k/v)
    cfg_batch: bool  # the conditional and unconditional passes as one batch of two
    vae_dtype: str  # "bfloat16" or "float32": what the VAE decodes in
    compile_mode: str = "default"  # torch.compile's mode for them ("max-autotune-no-cudagraphs": Triton GEMMs too)
    compile_vae: bool = False  # torch.compile the VAE's decoder (its norms, activations, pads and caches fused)
    conv_autotune: bool = False  # cuDNN times its convolution algorithms once per shape and keeps the fastest (VAE)
    attention: tuple[str, ...] = SDPA_PREFERENCE  # kernels by preference (ATTENTION_PREFERENCE's names)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def compiles(compile_mode: str, *, device: torch.device, memory_mode: str = "resident") -> bool:
    """Whether a pipeline's blocks are compiled: ``compile_mode`` is the worker's setting ("auto": on CUDA only; on
    the CPU a compile costs minutes and gains little; "on"; "off"). Never under ``low_vram``: its blocks move between
    devices as they run."""
    wanted = compile_mode == "on" or (compile_mode == "auto" and device.type == "cuda")
    return wanted and memory_mode == "resident"


def policy_for(
    tier: Precision, *, device: torch.device, compile_mode: str = "auto", memory_mode: str = "resident"
) -> TierPolicy:
    """The levers ``tier`` uses on ``device``; ``compile_mode`` as in ``compiles``. Under ``low_vram`` the blocks
    stream between devices as they run: no compile, no fused projections (new weights the streaming does not know),
    and the guidance passes stay two (a batch of two doubles the activations the mode exists to keep small)."""
    if tier not in BUILT:
        raise ValueError(f"tier {tier!r} is not built; built: {BUILT}")
    cuda = device.type == "cuda"
    resident = memory_mode == "resident"
    compiled = compiles(compile_mode, device=device, memory_mode=memory_mode)
    return TierPolicy(
        name=tier,
        compile_blocks=compiled,
        fused_qkv=resident,
        cfg_batch=resident,
        # The VAE in bf16 halves its memory traffic; its drift against float32 is in the GPU benchmark's results.
        # The CPU computes in float32 throughout.
        vae_dtype="bfloat16" if cuda else "float32",
        # One set of graphs per frame size, whatever the video's length (shared/render/pipeline.py).
        compile_vae=compiled,
        # FlashAttention 4 where it runs (Hopper, Blackwell, the package installed), else SDPA's preference.
        attention=ATTENTION_PREFERENCE if cuda else SDPA_PREFERENCE,
        # Off: on an H200 the autotuner's choice decoded no faster than cuDNN's heuristics (0.705 s against 0.704 at
        # 480×832×33), and its timing runs again on every new thread.
        conv_autotune=False,
    )


def eager_policy(tier: Precision = "exact") -> TierPolicy:
    """Every lever off: the model as diffusers runs it (two passes, VAE float32): the reference for drift."""
    return TierPolicy(name=tier, compile_blocks=False, fused_qkv=False, cfg_batch=False, vae_dtype="float32")


def resolve_tier(requested: Precision | None, default: Precision) -> tuple[Precision, str | None]:
    """The tier a job renders in, and a note when it is not the one asked for (None when it is)."""
    wanted = requested or default
    if wanted not in PRECISIONS:
        raise ValueError(f"unknown precision {wanted!r}; expected one of {PRECISIONS}")
    if wanted in BUILT:
        return wanted, None
    return BUILT[0], f"{wanted!r} is not available yet; rendered as {BUILT[0]!r}"


def tensor_format(tier: Precision, name: str, *, compute: str, vae: str) -> str:
    """The number format of the weight ``name`` (dotted, in the pipeline: ``transformer.blocks.3.attn1.to_q.weight``)
    under ``tier``: the first matching row of ``MODULE_TABLE``; ``compute``/``vae`` name the dtypes in use."""
    for pattern, fmt in applied_table(tier, compute=compute, vae=vae):
        if fnmatchcase(name, pattern):
            return fmt
    raise LookupError(f"no row of the {tier!r} table covers {name!r}")


@dataclass(frozen=True, slots=True)
class RenderedPrecision:
    """What a render's result says about its numbers: stored with the job (``timings.precision``)."""

    requested: Precision | None  # as the job asked (None: the worker's default)
    tier: Precision  # what rendered it
    policy: dict[str, Any]  # the levers (TierPolicy.describe())
    compute_dtype: str
    attention: str  # the SDPA backend that ran the self-attention, e.g. "CUDNN_ATTENTION"
    note: str | None = None  # why ``tier`` differs from what was asked
    modules: tuple[tuple[str, str], ...] = field(default=())  # the tier's table, as applied

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["modules"] = [list(row) for row in self.modules]
        if self.note is None:
            del record["note"]
        return record

    def with_request(self, requested: Precision | None, note: str | None) -> RenderedPrecision:
        return replace(self, requested=requested, note=note)


def applied_table(tier: Precision, *, compute: str, vae: str) -> tuple[tuple[str, str], ...]:
    """``MODULE_TABLE[tier]`` with the dtypes in use filled in (what the result shows)."""
    return tuple((pattern, {"compute": compute, "vae": vae}.get(fmt, fmt)) for pattern, fmt in MODULE_TABLE[tier])
