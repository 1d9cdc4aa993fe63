"""The fast tier's fp8 attention on the CPU: its quantization, its routing through diffusers' dispatcher, and its
Triton kernel run by Triton's interpreter (``TRITON_INTERPRET=1``, in a child process: the variable must be set
before Triton is first imported) against float32 attention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shared.render.fp8_attention import FP8_MAX, fp8_attention_unavailable, quantize, use_fp8_attention
from shared.render.registry import TINY_WAN, build_pipeline

CPU = torch.device("cpu")


def test_quantization_keeps_each_block_within_fp8_and_the_scores_unchanged() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 200, 3, 64, dtype=torch.bfloat16) for _ in range(3))
    k = k + 2.0  # a shared offset: smoothing takes it out
    q8, k8, v8, q_scale, k_scale, v_scale = quantize(q, k, v, 0.125)
    assert q8.dtype == k8.dtype == v8.dtype == torch.float8_e4m3fn
    assert q8.shape == k8.shape == (6, 256, 64) and v8.shape == (6, 64, 256)  # padded to 128 tokens
    assert q8.is_contiguous() and k8.is_contiguous() and v8.is_contiguous()
    assert q_scale.shape == k_scale.shape == (6, 2) and v_scale.shape == (6, 64)
    assert q8.float().abs().max() <= FP8_MAX and (q8[:, 200:].float() == 0).all()  # padding is zeros
    # Dequantized k is the smoothed k (mean over tokens subtracted), to fp8's precision.
    smoothed = (k.float() - k.float().mean(dim=1, keepdim=True)).transpose(1, 2).reshape(6, 200, 64)
    restored = (k8.float().view(6, 2, 128, 64) * k_scale[:, :, None, None]).view(6, 256, 64)[:, :200]
    assert ((restored - smoothed).norm() / smoothed.norm()) < 0.05
    # Smoothing shifts each query's scores by one constant: its softmax is unchanged.
    raw = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(2, 3)).softmax(-1)
    shifted = (q.float().transpose(1, 2) @ smoothed.view(2, 3, 200, 64).transpose(2, 3)).softmax(-1)
    assert torch.allclose(raw, shifted, atol=1e-5)


def test_it_runs_only_on_gpus_with_fp8_and_heads_it_is_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "CUDA GPUs only" in str(fp8_attention_unavailable(CPU, head_dim=128, dtype=torch.bfloat16))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    assert "8.9 or newer, not 8.0" in str(fp8_attention_unavailable(cuda, head_dim=128, dtype=torch.bfloat16))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "head sizes 64 and 128, not 96" in str(fp8_attention_unavailable(cuda, head_dim=96, dtype=torch.bfloat16))
    assert "not torch.float32" in str(fp8_attention_unavailable(cuda, head_dim=128, dtype=torch.float32))


def test_only_the_self_attentions_are_routed_to_it() -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    transformer = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=False).transformer
    assert use_fp8_attention(transformer) == len(transformer.blocks)
    for block in transformer.blocks:
        assert block.attn1.processor._attention_backend == AttentionBackendName.SAGE_HUB
        assert block.attn2.processor._attention_backend != AttentionBackendName.SAGE_HUB


KERNEL_CHECK = textwrap.dedent(
    """
    import json, os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from shared.render.fp8_attention import fp8_attention
    torch.manual_seed(0)
    results = []
    # (batch, query tokens, key tokens, heads, head size): padding on both sides, one batch with heads interleaved
    # in memory, keys fewer than a block (a cross-attention's shape).
    for b, nq, nk, h, d in ((1, 200, 300, 2, 64), (2, 128, 77, 1, 128), (1, 128, 128, 3, 64)):
        q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16) for n in (nq, nk, nk))
        out = fp8_attention(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2).float() for t in (q, k, v))
        ).transpose(1, 2)
        errors = [float((out[i, :, j].float() - ref[i, :, j]).norm() / ref[i, :, j].norm())
                  for i in range(b) for j in range(h)]
        ones = fp8_attention(q, k, torch.ones_like(v))
        results.append({"shape": [b, nq, nk, h, d], "dtype": str(out.dtype), "out": list(out.shape),
                        "errors": errors, "finite": bool(torch.isfinite(out).all()),
                        "ones": [float(ones.float().min()), float(ones.float().max())]})
    print(json.dumps(results))
    """
)


def test_the_kernel_computes_attention_to_fp8_precision_under_tritons_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for case in json.loads(done.stdout.strip().splitlines()[-1]):
        b, nq, _, h, d = case["shape"]
        assert case["dtype"] == "torch.bfloat16" and case["out"] == [b, nq, h, d] and case["finite"]
        # Random inputs give near-uniform attention, the hardest case for 8-bit P·V: each head within 10% (relative
        # L2) of float32; a head computed from another head's rows or unscaled would be off by ~100%.
        assert max(case["errors"]) < 0.10, case
        # Constant values come out constant: the weights sum to one, to P's 8-bit rounding (they are normalised by
        # the sum of the unrounded P).
        assert case["ones"][0] > 0.95 and case["ones"][1] < 1.05, case


def test_compiled_blocks_reach_it_through_diffusers_dispatcher_as_one_operator() -> None:
    """The route the GPU takes, on the CPU: the kernel has no CPU build, so a stand-in (SDPA) is registered for the
    operator's CPU dispatch; compiled blocks must call it once per self-attention and step, without a graph break."""
    from dataclasses import replace

    import numpy as np
    import torch.nn.functional as F

    from shared.render.fp8_attention import install_fp8_attention
    from shared.render.pipeline import VideoPipeline
    from shared.render.tiers import policy_for
    from tests.shared.render.test_registry import make_spec

    install_fp8_attention()
    calls: list[tuple[int, ...]] = []

    def on_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        calls.append(tuple(q.shape))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale)
        return out.transpose(1, 2).contiguous()

    torch.library.register_kernel("vidq::fp8_attention", "cpu", on_cpu)
    reference_pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=True)
    policy = replace(policy_for("exact", device=CPU, compile_mode="on"), compile_vae=False)
    reference = VideoPipeline(reference_pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy)
    expected = reference.generate(make_spec())
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=True)
    compiled = VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy)
    routed = use_fp8_attention(pipe.transformer)  # as the pipeline routes it on a GPU with fp8
    compiled.fp8_attention = "FP8_ATTENTION"
    torch._dynamo.utils.counters.clear()
    result = compiled.generate(make_spec())
    assert not torch._dynamo.utils.counters["graph_break"]
    assert len(calls) == routed * make_spec().steps  # each self-attention once per step, both passes batched
    assert result.precision.attention == "FP8_ATTENTION"
    assert np.abs(result.frames.astype(np.int16) - expected.frames).max() <= 1


# --- cuDNN's fp8 attention: the quantization around it, on the CPU with the operator's reference implementation ---


def test_cudnns_kernel_is_used_only_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.render import fp8_attention_cudnn
    from shared.render.fp8_attention import CUDNN_FP8_ATTENTION

    def why(head_dim: int = 128) -> str:
        return str(fp8_attention_unavailable(cuda, head_dim=head_dim, dtype=torch.bfloat16, kernel=CUDNN_FP8_ATTENTION))

    cuda = torch.device("cuda")
    assert "CUDA GPUs only" in str(
        fp8_attention_unavailable(CPU, head_dim=128, dtype=torch.bfloat16, kernel=CUDNN_FP8_ATTENTION)
    )
    assert "no fp8 attention kernel is called 'SAGE2'" in str(
        fp8_attention_unavailable(cuda, head_dim=128, dtype=torch.bfloat16, kernel="SAGE2")
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert "8.9 or newer, not 8.6" in why()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "multiples of 16 up to 256, not 12" in why(12)
    monkeypatch.setattr(fp8_attention_cudnn.importlib.util, "find_spec", lambda name: None)
    assert "nvidia-cudnn-frontend package is not installed" in why()


def test_cudnns_quantization_computes_attention_to_fp8_precision_eager_and_compiled() -> None:
    from shared.render import fp8_attention_cudnn

    torch.manual_seed(0)
    for b, nq, nk, h, d in ((2, 300, 300, 3, 128), (1, 200, 77, 2, 64)):
        q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16) for n in (nq, nk, nk))
        k = k + 3.0  # a shared offset: without the smoothing it would take most of K's 8 bits
        want = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2)
        got = fp8_attention_cudnn.attention(q, k, v)
        assert got.shape == q.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
        assert ((got.float() - want).norm() / want.norm()) < 0.08  # 8-bit P and output; bf16 would be ~0.003
        compiled = torch.compile(fp8_attention_cudnn.attention, fullgraph=True)(q, k, v)
        assert torch.equal(compiled, got)
        # The operator sees fp8 inputs that use e4m3's range, each scaled by its largest magnitude.
        ones = fp8_attention_cudnn.attention(q, k, torch.ones_like(v))
        assert ones.float().min() > 0.95 and ones.float().max() < 1.05


def test_compiled_blocks_reach_cudnns_kernel_through_diffusers_dispatcher_as_one_operator() -> None:
    """The GPU's route on the CPU: the operator's CPU implementation (the reference) counts its calls."""
    from dataclasses import replace

    from shared.render import fp8_attention_cudnn
    from shared.render.fp8_attention import CUDNN_FP8_ATTENTION
    from shared.render.pipeline import VideoPipeline
    from shared.render.tiers import policy_for
    from tests.shared.render.test_registry import make_spec

    calls: list[torch.dtype] = []

    def counting(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(q.dtype)
        return fp8_attention_cudnn.reference(q, *args)  # type: ignore[arg-type]

    policy = replace(policy_for("exact", device=CPU, compile_mode="on"), compile_vae=False)
    reference = VideoPipeline(
        build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=True),
        model=TINY_WAN,
        device=CPU,
        dtype=torch.float32,
        policy=policy,
    ).generate(make_spec())
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32, text_encoder=True)
    compiled = VideoPipeline(pipe, model=TINY_WAN, device=CPU, dtype=torch.float32, policy=policy)
    routed = use_fp8_attention(pipe.transformer, kernel=CUDNN_FP8_ATTENTION)
    compiled.fp8_attention = CUDNN_FP8_ATTENTION
    torch.library.register_kernel("vidq::cudnn_fp8_attention", "cpu", counting)
    try:
        torch._dynamo.utils.counters.clear()
        result = compiled.generate(make_spec())
    finally:
        torch.library.register_kernel("vidq::cudnn_fp8_attention", "cpu", fp8_attention_cudnn.reference)
        use_fp8_attention(pipe.transformer)  # the slot back to its default kernel for the other tests
    assert not torch._dynamo.utils.counters["graph_break"]
    assert calls == [torch.float8_e4m3fn] * (routed * make_spec().steps)  # once per self-attention and step
    assert result.precision.attention == CUDNN_FP8_ATTENTION
    # Noise from random weights, through 8-bit attention: close to the bf16 frames, not equal to them.
    diff = np.abs(result.frames.astype(np.int16) - reference.frames)
    assert 0 < diff.mean() < 8
