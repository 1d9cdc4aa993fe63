"""8-bit attention for the fast tier: softmax attention with both of its products on fp8 tensor cores.

Q·Kᵀ and P·V run in float8 (e4m3) with float32 accumulation, where bf16 kernels run them in bf16; on fp8 tensor cores
each product has twice the bf16 rate. Two kernels, each a name a tier's attention preference can hold:

* ``CUDNN_FP8_ATTENTION`` — cuDNN's fused fp8 attention (shared/render/fp8_attention_cudnn.py, through the
  ``nvidia-cudnn-frontend`` package): one scale per tensor, K smoothed by its mean.
* ``FP8_ATTENTION`` — vidq's own kernel, written in Triton (below and shared/render/fp8_attention_kernel.py):

  * Q and K: one scale per 128 tokens of each head (an outlier token costs only its block). K is first smoothed:
    its mean over the tokens is subtracted per head and channel, which shifts every score of a query by the same
    amount and so leaves the softmax unchanged, while it takes the shared offset out of what the 8 bits must
    represent. The softmax scale (and log2 e, for exp2) is folded into Q's scale.
  * P (the softmax's numerators, in [0, 1]): scaled by 448, e4m3's largest value, before its product.
  * V: one scale per channel of each head, applied to the output.

  FlashAttention's online softmax over blocks of keys, one program per 128 queries of one head. On an H200 it ran
  386 TFLOP/s at 14,040 tokens and 533 at 32,760, where cuDNN's bf16 kernel runs 600 and 549, with a relative error
  of 0.054 against float32 attention (cuDNN's bf16: 0.0023): it lacks what makes FlashAttention 3/4 and cuDNN fast
  on Hopper (warp-specialised producer and consumer warps, tensor-memory-accelerator loads), so no tier's preference
  names it (a policy may; benchmarks/gpu_fast.py measures it beside cuDNN's, which ran 766 and 780 TFLOP/s there).

Either is reached through the backend diffusers names ``sage_hub`` (diffusers' slot for 8-bit attention, whose
kernel it otherwise downloads from the Hugging Face Hub), for the self-attentions only (the cross-attentions' 512
keys leave nothing to gain): compiled transformer blocks call it as one opaque operator. The slot is one per
process, so a process routes all its fp8 attention to one of the two kernels, the last one routed.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

from shared.render import fp8_attention_cudnn
from shared.render.quantize import FP8_CAPABILITY, FP8_MAX

FP8_ATTENTION = "FP8_ATTENTION"  # vidq's Triton kernel, by its name in a tier's attention preference and in results
CUDNN_FP8_ATTENTION = "CUDNN_FP8_ATTENTION"  # cuDNN's
FP8_KERNELS = (CUDNN_FP8_ATTENTION, FP8_ATTENTION)
BLOCK = 128  # tokens per scale block of Q and K, per program of queries, and the padding of every sequence


def fp8_attention_unavailable(
    device: torch.device, *, head_dim: int, dtype: torch.dtype, kernel: str = FP8_ATTENTION
) -> str | None:
    """Why ``kernel`` (one of ``FP8_KERNELS``) cannot run a model's attention (heads of ``head_dim``, in ``dtype``)
    on ``device``; None when it can."""
    if kernel not in FP8_KERNELS:
        return f"no fp8 attention kernel is called {kernel!r} (known: {', '.join(FP8_KERNELS)})"
    if device.type != "cuda":
        return f"it runs on CUDA GPUs only, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bf16 or fp16 inputs, not {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return f"fp8 tensor cores need compute capability 8.9 or newer, not {capability[0]}.{capability[1]}"
    if kernel == CUDNN_FP8_ATTENTION:
        return fp8_attention_cudnn.unavailable(device, head_dim=head_dim)
    if head_dim not in (64, 128):
        return f"its kernel is built for head sizes 64 and 128, not {head_dim}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def quantize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, storage: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, tokens, heads, head_dim) q, k, v → fp8 q and k as (batch·heads, padded tokens, head_dim), fp8 v as
    (batch·heads, head_dim, padded tokens), and their scales: per 128-token block of q and of k, per channel of v.
    Padding tokens are zeros (the kernel masks the keys among them)."""
    batch, nq, heads, dim = q.shape
    nk = k.shape[1]
    fp8 = storage

    def blocks(x: torch.Tensor, tokens: int) -> torch.Tensor:  # (B·H, padded, D) float32, zero-padded
        x = x.transpose(1, 2).reshape(batch * heads, tokens, dim).float()
        # contiguous: the kernel indexes rows of head_dim; a reshape may keep the heads interleaved (one batch)
        return torch.nn.functional.pad(x, (0, 0, 0, -tokens % BLOCK)).contiguous()

    def per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = x.view(x.shape[0], -1, BLOCK, dim)
        scale = grouped.abs().amax(dim=(2, 3), keepdim=True).clamp(min=1e-12) / FP8_MAX
        return (grouped / scale).view_as(x).to(fp8), scale.view(x.shape[0], -1).contiguous()

    q8, q_scale = per_block(blocks(q, nq) * (softmax_scale * math.log2(math.e)))
    smoothed = k.float() - k.float().mean(dim=1, keepdim=True)
    k8, k_scale = per_block(blocks(smoothed, nk))
    vf = blocks(v, nk)
    v_scale = vf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (B·H, 1, D)
    v8 = (vf / v_scale).to(fp8).transpose(1, 2).contiguous()  # keys contiguous: the layout fp8 P·V wants
    return q8, k8, v8, q_scale, k_scale, v_scale.view(batch * heads, dim).contiguous()


def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None
) -> torch.Tensor:
    """Softmax attention of (batch, tokens, heads, head_dim) q, k, v (bf16 or fp16; k and v may have another number
    of tokens than q) in fp8; the output is (batch, tokens of q, heads, head_dim) in q's dtype."""
    batch, nq, heads, dim = q.shape
    nk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else dim**-0.5
    q8, k8, v8, q_scale, k_scale, v_scale = quantize(q, k, v, scale)
    out = torch.empty_like(q)
    kernel = _kernel()
    grid = (q8.shape[1] // BLOCK, batch * heads)
    kernel[grid](
        q8,
        k8,
        v8,
        out,
        q_scale,
        k_scale,
        v_scale,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        heads,
        nq,
        nk,
        nk // BLOCK * BLOCK,
        q8.shape[1],
        k8.shape[1],
        HEAD_DIM=dim,
        BLOCK_M=BLOCK,
    )
    return out


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, imported on first use: Triton is needed only where the kernel runs."""
    from shared.render import fp8_attention_kernel

    return fp8_attention_kernel.forward()


def use_fp8_attention(
    transformer: torch.nn.Module, *, kernel: str = FP8_ATTENTION, names: tuple[str, ...] = ("attn1",)
) -> int:
    """Route the attentions of ``transformer`` whose module name ends in one of ``names`` (by default the
    self-attentions) to ``kernel``, one of ``FP8_KERNELS``. Returns how many."""
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    install_fp8_attention()
    _HUB_KERNELS_REGISTRY[AttentionBackendName.SAGE_HUB].kernel_fn = (
        _as_sage_cudnn if kernel == CUDNN_FP8_ATTENTION else _as_sage
    )
    routed = 0
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if name.rsplit(".", 1)[-1] in names and processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = AttentionBackendName.SAGE_HUB
            routed += 1
    return routed


@functools.cache
def install_fp8_attention() -> None:
    """Define ``torch.ops.vidq.fp8_attention``, the Triton kernel's operator (once per process)."""
    schema = "(Tensor q, Tensor k, Tensor v, float? softmax_scale) -> Tensor"

    @torch.library.custom_op("vidq::fp8_attention", mutates_args=(), schema=schema)
    def operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
        return fp8_attention(q, k, v, softmax_scale)

    @operator.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
        return torch.empty_like(q)


def _as_sage(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "NHD",
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor:
    """The Triton kernel as diffusers' ``sage_hub`` backend calls it: (batch, tokens, heads, head_dim) in and out."""
    _check_call(tensor_layout, is_causal, return_lse)
    out: torch.Tensor = torch.ops.vidq.fp8_attention(q, k, v, sm_scale)
    return out


def _as_sage_cudnn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "NHD",
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor:
    """cuDNN's kernel as diffusers' ``sage_hub`` backend calls it; its quantization is traced into the compiled
    blocks, the operator stays opaque."""
    _check_call(tensor_layout, is_causal, return_lse)
    return fp8_attention_cudnn.attention(q, k, v, sm_scale)


def _check_call(tensor_layout: str, is_causal: bool, return_lse: bool) -> None:
    if tensor_layout != "NHD" or is_causal or return_lse:
        raise ValueError("vidq's fp8 attention runs non-causal attention in the NHD layout, without the LSE")
