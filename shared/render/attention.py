"""Which kernel computes a transformer's attention: FlashAttention 4 where it runs, else SDPA's backends by preference.

Both compute the same exact softmax attention in bf16 with fp32 accumulation; they differ in how the work is tiled
and scheduled on the GPU, so their results differ by rounding only (the GPU benchmark records by how much).

* FlashAttention 4 (the ``flash-attn-4`` package, ``pip install 'vidq[flash4]'``): kernels written in NVIDIA's CuTe
  DSL for Hopper (compute capability 9.x) and Blackwell (10.x), compiled on first use for each shape and kept in
  the worker's compile cache. Used when the tier asks for it, the package is installed and the GPU is one of those.
* SDPA (``torch.nn.functional.scaled_dot_product_attention``): the backends in ``SDPA_PREFERENCE`` order, the first
  that can run the call's shape and dtype. cuDNN's fused kernel is the fastest of them on Hopper at Wan's shapes.

diffusers routes each attention call through its dispatcher by the processor's backend name; FlashAttention 4 is
reached through the backend diffusers names ``flash_4_hub``, whose kernel diffusers otherwise downloads from the
Hugging Face Hub. Here the kernel is the installed package's instead (a worker needs no Hub access), wrapped as a
torch operator so that compiled transformer blocks call it as one opaque kernel.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

FLASH_ATTENTION_4 = "FLASH_ATTENTION_4"

# SDPA backends in order of preference: the first that can run the call's shape and dtype is used.
SDPA_PREFERENCE = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")

FLASH4_ARCHITECTURES = (9, 10)  # compute capability majors its kernels are written for: Hopper, Blackwell


def flash4_unavailable(device: torch.device, *, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why FlashAttention 4 cannot run a model's attention (heads of ``head_dim``, in ``dtype``) on ``device``; None
    when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs only, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it computes in bf16 or fp16, not {dtype}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH4_ARCHITECTURES:
        return f"it runs on compute capability 9.x and 10.x, not {major}.{minor}"
    # Its kernels' head sizes: multiples of 8 (16-byte rows), up to 256 on Hopper, up to 128 or exactly 256 on
    # Blackwell.
    if head_dim % 8 or not (8 <= head_dim <= 256) or (major == 10 and 128 < head_dim < 256):
        return f"its kernels have no head size {head_dim} on compute capability {major}.x"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # another package owns the name flash_attn (FlashAttention 2)
        found = False
    if not found:
        return "the flash-attn-4 package is not installed"
    return None


def use_flash4(transformer: torch.nn.Module) -> int:
    """Route every attention of ``transformer`` to FlashAttention 4. Returns how many attention modules now use it
    (0: the model's processors do not go through diffusers' dispatcher)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    install_flash4()
    routed = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = AttentionBackendName.FLASH_4_HUB
            routed += 1
    return routed


@functools.cache
def install_flash4() -> None:
    """Define ``torch.ops.vidq.flash_attention_4`` (once per process) and put it where diffusers' ``flash_4_hub``
    backend looks for its Hub download. torch.compile cannot trace into the CuTe DSL's Python, so the kernel is an
    operator with a declared output shape, which compiled graphs call as it is."""
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    schema = "(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal) -> Tensor"

    @torch.library.custom_op("vidq::flash_attention_4", mutates_args=(), schema=schema)
    def flash_attention_4(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool
    ) -> torch.Tensor:
        from flash_attn.cute import flash_attn_func

        result: Any = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
        out: torch.Tensor = result[0] if isinstance(result, tuple) else result  # (out, lse) when asked for lse
        return out

    @flash_attention_4.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool) -> torch.Tensor:
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn = _flash4


def _flash4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """The kernel as diffusers' ``flash_4_hub`` backend calls it: (batch, tokens, heads, head_dim) in and out."""
    out: torch.Tensor = torch.ops.vidq.flash_attention_4(q, k, v, softmax_scale, causal)
    return out
