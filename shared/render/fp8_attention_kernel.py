"""The Triton kernel of the fast tier's fp8 attention (shared/render/fp8_attention.py says what it computes): one
program per 128 queries of one head, FlashAttention's online softmax over blocks of keys, both products on fp8
tensor cores with float32 accumulation."""

from __future__ import annotations

import functools
import os
from typing import Any

import triton
import triton.language as tl

SCALE_BLOCK = tl.constexpr(128)  # tokens per scale of Q and K (fp8_attention.BLOCK)


@triton.jit
def _block_of_keys(
    acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, start_n, nk, nk_pad,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One block of keys: scores, the online softmax's update, and P·V into the accumulator."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    k_scale = tl.load(ks_base + start_n // 128)
    qk = tl.dot(q, tl.trans(k)) * (q_scale * k_scale)
    if MASKED:  # keys past the sequence's end are padding
        qk = tl.where(offs_n[None, :] < nk, qk, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs_d[None, :] * nk_pad + offs_n[:, None])  # V is stored keys-contiguous
    acc = tl.dot((p * 448.0).to(v.dtype), v, acc * alpha[:, None])
    return acc, m_ij, l_i


@triton.jit
def _forward(
    Q, K, V, Out, QS, KS, VS, stride_ob, stride_on, stride_oh, heads, nq, nk, nk_full, nq_pad, nk_pad,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + bh * nq_pad * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    q_scale = tl.load(QS + bh * (nq_pad // SCALE_BLOCK) + pid_m * BLOCK_M // SCALE_BLOCK)
    k_base = K + bh * nk_pad * HEAD_DIM
    v_base = V + bh * HEAD_DIM * nk_pad
    ks_base = KS + bh * (nk_pad // SCALE_BLOCK)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, nk_full, BLOCK_N):  # whole blocks of real keys: no mask
        acc, m_i, l_i = _block_of_keys(
            acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, start_n, nk, nk_pad, HEAD_DIM, BLOCK_N, False
        )
    for start_n in range(nk_full, nk_pad, BLOCK_N):  # the last real keys and the padding after them
        acc, m_i, l_i = _block_of_keys(
            acc, m_i, l_i, q, q_scale, k_base, v_base, ks_base, start_n, nk, nk_pad, HEAD_DIM, BLOCK_N, True
        )
    v_scale = tl.load(VS + bh * HEAD_DIM + offs_d)
    out = acc * (v_scale / 448.0)[None, :] / l_i[:, None]
    b = bh // heads
    h = bh % heads
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < nq)


CONFIGS = [
    triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
    for block_n in (64, 128)
    for warps in (4, 8)
    for stages in (3, 4)
]


def forward() -> Any:
    """The kernel to launch as ``kernel[grid](...)``: autotuned per (padded keys, head size) on a GPU (the fastest
    configuration, timed on first use of each); with one fixed configuration under Triton's CPU interpreter
    (``TRITON_INTERPRET=1``: tests), which cannot time them."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _Fixed(_forward, BLOCK_N=64)
    return triton.autotune(configs=CONFIGS, key=["nk_pad", "HEAD_DIM"])(_forward)


class _Fixed:
    """A kernel launched with fixed meta-parameters, called as an autotuned one is: ``kernel[grid](...)``."""

    def __init__(self, kernel: Any, **meta: Any) -> None:
        self.kernel, self.meta = kernel, meta

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return functools.partial(self.kernel[grid], **self.meta)
