"""An 8-bit attention kernel for the fast tier: softmax attention with both of its products on fp8 tensor cores.

Q·Kᵀ and P·V run in float8 (e4m3) with float32 accumulation, where bf16 kernels run them in bf16; on fp8 tensor cores
each product has twice the bf16 rate. The scaling keeps what 8 bits can hold:

* Q and K: one scale per 128 tokens of each head (an outlier token costs only its block). K is first smoothed: its
  mean over the tokens is subtracted per head and channel, which shifts every score of a query by the same amount and
  so leaves the softmax unchanged, while it takes the shared offset out of what the 8 bits must represent.
  The softmax scale (and log2 e, for exp2) is folded into Q's scale.
* P (the softmax's numerators, in [0, 1]): scaled by 448, e4m3's largest value, before its product.
* V: one scale per channel of each head, applied to the output.

The kernel is written in Triton (``_forward``): FlashAttention's online softmax over blocks of keys, one program per
128 queries of one head. The quantization around it is plain torch (one pass over q, k and v, a few percent of the
attention's time at Wan's shapes). It is reached as the ``torch.ops.vidq.fp8_attention`` operator, so compiled
transformer blocks call it as one opaque kernel, through the backend diffusers names ``sage_hub`` (diffusers' slot for
8-bit attention, whose kernel it otherwise downloads from the Hugging Face Hub), for the self-attentions of a policy
whose attention preference names ``FP8_ATTENTION``.

No tier names it: on an H200 it ran 386 TFLOP/s at 14,040 tokens and 533 at 32,760, where cuDNN's bf16 kernel runs
600 and 549, with a relative error of 0.054 against float32 attention (cuDNN's bf16: 0.0023); benchmarks/gpu_fast.py
measures it beside the others. It lacks what makes FlashAttention 3/4 and cuDNN fast on Hopper: warp-specialised
producer and consumer warps and tensor-memory-accelerator loads.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch

from shared.render.quantize import FP8_CAPABILITY, FP8_MAX

FP8_ATTENTION = "FP8_ATTENTION"  # the kernel's name in a tier's attention preference and in results
BLOCK = 128  # tokens per scale block of Q and K, per program of queries, and the padding of every sequence


def fp8_attention_unavailable(device: torch.device, *, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run a model's attention (heads of ``head_dim``, in ``dtype``) on ``device``; None when
    it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs only, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bf16 or fp16 inputs, not {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return f"fp8 tensor cores need compute capability 8.9 or newer, not {capability[0]}.{capability[1]}"
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


def use_fp8_attention(transformer: torch.nn.Module, *, names: tuple[str, ...] = ("attn1",)) -> int:
    """Route the attentions of ``transformer`` whose module name ends in one of ``names`` (by default the
    self-attentions: the cross-attentions' 512 keys leave nothing to gain) to the fp8 kernel. Returns how many."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    install_fp8_attention()
    routed = 0
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if name.rsplit(".", 1)[-1] in names and processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = AttentionBackendName.SAGE_HUB
            routed += 1
    return routed


@functools.cache
def install_fp8_attention() -> None:
    """Define ``torch.ops.vidq.fp8_attention`` (once per process) and put it where diffusers' ``sage_hub`` backend
    looks for its Hub download."""
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    schema = "(Tensor q, Tensor k, Tensor v, float? softmax_scale) -> Tensor"

    @torch.library.custom_op("vidq::fp8_attention", mutates_args=(), schema=schema)
    def operator(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
        return fp8_attention(q, k, v, softmax_scale)

    @operator.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> torch.Tensor:
        return torch.empty_like(q)

    _HUB_KERNELS_REGISTRY[AttentionBackendName.SAGE_HUB].kernel_fn = _as_sage


def _as_sage(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensor_layout: str = "NHD",
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor:
    """The kernel as diffusers' ``sage_hub`` backend calls it: (batch, tokens, heads, head_dim) in and out."""
    if tensor_layout != "NHD" or is_causal or return_lse:
        raise ValueError("vidq's fp8 attention runs non-causal attention in the NHD layout, without the LSE")
    out: torch.Tensor = torch.ops.vidq.fp8_attention(q, k, v, sm_scale)
    return out
