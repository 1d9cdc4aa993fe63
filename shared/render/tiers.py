"""Precision tiers: how a job's video is computed, one table per tier, and what a render says about it.

A job names a tier (``precision`` on the request; the worker's ``VIDQ_WORKER_PRECISION`` when it names none):

* ``exact`` — the model's own math in bf16 (float32 on the CPU), with the fastest kernels that keep it: the
  transformer's repeated blocks compiled (fused elementwise work around cuBLAS GEMMs and SDPA's attention), the
  query/key/value projections as one GEMM, the conditional and unconditional passes of classifier-free guidance
  as one batch of two, attention on FlashAttention 4 where it runs and otherwise on SDPA's backend chosen by
  preference (shared/render/attention.py; the kernel that ran is recorded), the VAE decoding in bf16 with its
  decoder compiled. None of it changes what is computed, only how; the rounding differs from a plain eager call by
  the amounts the GPU benchmark records (PSNR of frames, largest latent difference).
* ``fast`` — ``exact`` with the transformer blocks' matrix products in 8 bits (shared/render/quantize.py): on GPUs
  with fp8 tensor cores (compute capability 8.9 and newer) fp8 with one scale per row of weights and of activations;
  on other GPUs and the CPU int8 weights (the GPU decides, not the job; the result says which ran). The ends of the
  network stay in the compute dtype: the patch embedding (the input), the condition embedder (the timestep and the
  prompt, which reach every token) and the output projection, and the cross-attention's keys and values (computed
  over the prompt's 512 rows only: nothing to gain). Its self-attention runs in 8 bits too, on cuDNN's fused fp8
  kernel where the GPU has fp8 and the ``nvidia-cudnn-frontend`` package is installed (shared/render/fp8_attention.py,
  ``pip install 'vidq[fp8attn]'``), else as in ``exact``. On an H200 that kernel, its quantization included, ran 766
  and 780 TFLOP/s at 14,040 and 32,760 tokens, where cuDNN's bf16 kernel runs 611 and 571 and FlashAttention 4 699
  and 677, and the frames' PSNR against a plain call stayed where the 8-bit GEMMs put it (44.0 and 43.7 dB). vidq's
  own Triton fp8 kernel measured slower than bf16, so no tier's preference names it (a policy may, for benchmarks).
  Its drift against a plain bf16 call is in the GPU benchmark's results.

``TierPolicy`` holds the levers; ``MODULE_TABLE`` says, per weight of a Wan pipeline, which number format its
weights and compute use under a tier (first matching pattern wins). A render's result names the tier that ran, the
levers, the table as it ran on that device, the attention kernel and the step cache (``RenderedPrecision``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

import torch

from shared.render.attention import FLASH_ATTENTION_4, SDPA_PREFERENCE
from shared.render.fp8_attention import CUDNN_FP8_ATTENTION
from shared.render.quantize import EIGHT_BIT
from shared.spec import PRECISIONS, Precision

# The tiers this build renders; a requested tier not in here renders as the first one, and the result says so.
BUILT: tuple[Precision, ...] = ("exact", "fast")

# Kept in float32 whatever the tier, as the model's own code asks (its norms, rotary tables and timestep embedding;
# compiled, they fuse into the bf16 kernels around them and cost no extra memory traffic).
_FP32 = (
    ("transformer.rope.*", "fp32"),
    ("transformer.condition_embedder.time_embedder.*", "fp32"),
    ("transformer.scale_shift_table", "fp32"),
    ("transformer.blocks.*.scale_shift_table", "fp32"),
    ("transformer.blocks.*.norm[123].*", "fp32"),
)

# Per weight (its dotted name in the pipeline, glob patterns, first match wins): the number format under each tier.
# "compute" is the tier's compute dtype (bf16 on CUDA, float32 on the CPU); "fp32" is kept in float32 (``_FP32``);
# "linear8" is the device's 8-bit format for a Linear layer's weight (shared/render/quantize.py: fp8 rowwise where
# the GPU has fp8, else int8 weight-only), its bias staying in the compute dtype.
MODULE_TABLE: dict[Precision, tuple[tuple[str, str], ...]] = {
    "exact": (
        *_FP32,
        ("transformer.*", "compute"),
        ("text_encoder.*", "compute"),
        ("vae.*", "vae"),
    ),
    "fast": (
        *_FP32,
        # The network's ends and its conditioning: an error there reaches every token.
        ("transformer.patch_embedding.*", "compute"),
        ("transformer.condition_embedder.*", "compute"),
        ("transformer.proj_out.*", "compute"),
        # The cross-attention's keys and values: over the prompt's 512 rows, too few to gain from 8 bits.
        ("transformer.blocks.*.attn2.to_k.*", "compute"),
        ("transformer.blocks.*.attn2.to_v.*", "compute"),
        ("transformer.blocks.*.attn2.to_kv.*", "compute"),
        # The blocks' projections (q/k/v fused or not, the output) and feed-forward layers: nearly all the GEMM work.
        ("transformer.blocks.*.attn[12].to_*.weight", EIGHT_BIT),
        ("transformer.blocks.*.ffn.net.*.weight", EIGHT_BIT),
        ("transformer.*", "compute"),
        ("text_encoder.*", "compute"),
        ("vae.*", "vae"),
    ),
}

# Attention kernels in order of preference: the first that can run on the device, the call's shape and dtype is used
# (shared/render/attention.py). The SDPA names are SDPA's own backends.
ATTENTION_PREFERENCE = (FLASH_ATTENTION_4, *SDPA_PREFERENCE)
# The fast tier's: cuDNN's fp8 kernel for the self-attentions first (the others then run as in ATTENTION_PREFERENCE).
FAST_ATTENTION_PREFERENCE = (CUDNN_FP8_ATTENTION, *ATTENTION_PREFERENCE)


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
    # What the table's "linear8" layers run as: "linear8" (the device's 8-bit format), a format's name
    # (shared/render/quantize.py FORMATS; benchmarks compare them on one GPU), or "" (the compute dtype).
    eight_bit: str = ""

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
        # FlashAttention 4 where it runs (Hopper, Blackwell, the package installed), else SDPA's preference; the fast
        # tier's self-attentions on cuDNN's fp8 kernel before those.
        attention=(FAST_ATTENTION_PREFERENCE if tier == "fast" else ATTENTION_PREFERENCE) if cuda else SDPA_PREFERENCE,
        # Off: on an H200 the autotuner's choice decoded no faster than cuDNN's heuristics (0.705 s against 0.704 at
        # 480×832×33), and its timing runs again on every new thread.
        conv_autotune=False,
        eight_bit=EIGHT_BIT if tier == "fast" else "",
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
    under ``tier``: the first matching row of ``MODULE_TABLE``, with ``compute``/``vae`` naming the dtypes in use; an
    8-bit row gives the format the table asks for."""
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
    attention: str  # the kernel that ran the self-attention, e.g. "FLASH_ATTENTION_4", "CUDNN_ATTENTION"
    note: str | None = None  # why ``tier`` differs from what was asked
    modules: tuple[tuple[str, str], ...] = field(default=())  # the tier's table, as applied on this device
    # Per 8-bit format the table asks for: {"asked", "runs", "layers", "reason"?} (empty: the tier has none).
    linear: tuple[dict[str, Any], ...] = ()
    # The step cache: {"preset", "computed_steps", "steps"} (None: not recorded, e.g. a pipeline's description).
    step_cache: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["modules"] = [list(row) for row in self.modules]
        record["linear"] = list(self.linear)
        for optional in ("note", "linear", "step_cache"):
            if not record[optional]:
                del record[optional]
        return record

    def with_request(self, requested: Precision | None, note: str | None) -> RenderedPrecision:
        return replace(self, requested=requested, note=note)


def applied_table(
    tier: Precision, *, compute: str, vae: str, ran: Mapping[str, str] = MappingProxyType({})
) -> tuple[tuple[str, str], ...]:
    """``MODULE_TABLE[tier]`` with the formats in use filled in (what the result shows): ``compute`` and ``vae``
    name the dtypes, ``ran`` maps each 8-bit format the table asks for to what it ran as on this device ("compute"
    when it fell back to the compute dtype)."""
    names = {
        "compute": compute,
        "vae": vae,
        **{asked: compute if runs == "compute" else runs for asked, runs in ran.items()},
    }
    return tuple((pattern, names.get(fmt, fmt)) for pattern, fmt in MODULE_TABLE[tier])


def is_eight_bit(fmt: str) -> bool:
    """Whether a table's format asks for an 8-bit layer (anything but the dtypes' own names)."""
    return fmt not in TABLE_DTYPES


TABLE_DTYPES = ("compute", "fp32", "vae")  # the table's names that are dtypes; any other asks for an 8-bit format
