"""cuDNN's fused fp8 attention, the fast tier's 8-bit attention where the ``nvidia-cudnn-frontend`` package is
installed (``pip install 'vidq[fp8attn]'``).

cuDNN runs Q·Kᵀ and P·V on fp8 (e4m3) tensor cores with float32 accumulation and the softmax in float32, with one
scale per tensor: ``descale_q``, ``descale_k`` and ``descale_v`` turn the stored 8-bit values back into real ones,
P (the softmax's numerators, in [0, 1]) is scaled by 448 before its product and back after, and the output is stored
in fp8 too (Hopper's kernels write no bf16) with ``scale_o``.

This file is the operator only: it takes tensors already in fp8 and returns fp8. The quantization around it
(shared/render/fp8_attention.py, ``per_tensor``) stays in the compiled transformer blocks, where it fuses with the
projections before it and the output projection after it.

The operator, ``torch.ops.vidq.cudnn_fp8_attention``, builds one cuDNN graph per shape on its first call (kept,
the least recently used dropped beyond ``PLANS``) and runs it on torch's current stream. On the CPU the operator
computes the same in float32 from the dequantized inputs, the reference the tests compare the wrapper with.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from shared.render.quantize import FP8_CAPABILITY, FP8_MAX

PLANS = 32  # built graphs kept per process: one per (batch, heads, tokens, key tokens, head size, scale)
SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor descale_q, Tensor descale_k, Tensor descale_v, Tensor scale_o, "
    "float softmax_scale) -> Tensor"
)


def unavailable(device: torch.device, *, head_dim: int) -> str | None:
    """Why cuDNN's fp8 attention cannot run heads of ``head_dim`` on ``device``; None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs only, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return f"fp8 tensor cores need compute capability 8.9 or newer, not {capability[0]}.{capability[1]}"
    if head_dim % 16 or head_dim > 256:
        return f"cuDNN's fp8 kernels take head sizes that are multiples of 16 up to 256, not {head_dim}"
    if importlib.util.find_spec("cudnn") is None:
        return "the nvidia-cudnn-frontend package is not installed"
    return None


@dataclass
class _Plan:
    """A built cuDNN graph for one shape, with its graph tensors and what it needs beside the caller's tensors."""

    graph: Any
    tensors: dict[str, Any]  # name → the graph's tensor
    constants: dict[str, torch.Tensor]  # scale_s, descale_s and the amax outputs
    workspace: torch.Tensor


def _frontend() -> Any:
    """The cudnn-frontend package, imported after torch has loaded its cuDNN library: the package then finds that
    library among those loaded instead of searching for another copy."""
    torch.backends.cudnn.version()  # type: ignore[no-untyped-call,unused-ignore]
    import cudnn

    return cudnn


@functools.cache
def _handle(index: int) -> Any:
    cudnn = _frontend()
    with torch.cuda.device(index):
        return cudnn.create_handle()


@functools.lru_cache(maxsize=PLANS)
def _plan(index: int, batch: int, heads: int, nq: int, nk: int, dim: int, softmax_scale: float) -> _Plan:
    """The graph for (batch, tokens, heads, head_dim) q and (batch, key tokens, heads, head_dim) k and v, contiguous
    in that order (cuDNN sees them as batch, heads, tokens, head_dim with the matching strides)."""
    cudnn = _frontend()

    device = torch.device("cuda", index)
    fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32, handle=_handle(index))

    def layout(tokens: int) -> dict[str, Any]:
        return {"dim": [batch, heads, tokens, dim], "stride": [tokens * heads * dim, dim, heads * dim, 1]}

    scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": fp32}
    t = {name: graph.tensor(name=name, data_type=fp8, **layout(nq if name == "q" else nk)) for name in "qkv"}
    for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        t[name] = graph.tensor(name=name, **scalar)
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=t["q"],
        k=t["k"],
        v=t["v"],
        descale_q=t["descale_q"],
        descale_k=t["descale_k"],
        descale_v=t["descale_v"],
        descale_s=t["descale_s"],
        scale_s=t["scale_s"],
        scale_o=t["scale_o"],
        is_inference=True,
        attn_scale=softmax_scale,
        use_causal_mask=False,
        name="attention",
    )
    o.set_output(True).set_data_type(fp8).set_dim(layout(nq)["dim"]).set_stride(layout(nq)["stride"])
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_data_type(fp32).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
    t |= {"o": o, "amax_s": amax_s, "amax_o": amax_o}
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()

    def scalar_tensor(value: float) -> torch.Tensor:
        return torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)

    constants = {
        "scale_s": scalar_tensor(FP8_MAX),
        "descale_s": scalar_tensor(1 / FP8_MAX),
        "amax_s": scalar_tensor(0.0),
        "amax_o": scalar_tensor(0.0),
    }
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=device)
    return _Plan(graph, t, constants, workspace)


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    scale_o: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    cudnn = _frontend()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the layout the plan was built for
    batch, nq, heads, dim = q.shape
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    plan = _plan(index, batch, heads, nq, k.shape[1], dim, float(softmax_scale))
    out = q.new_empty(q.shape)
    given = {"q": q, "k": k, "v": v, "o": out, "descale_q": descale_q, "descale_k": descale_k}
    given |= {"descale_v": descale_v, "scale_o": scale_o}
    pack = {plan.tensors[name]: tensor for name, tensor in (given | plan.constants).items()}
    handle = _handle(index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    plan.graph.execute(pack, plan.workspace, handle=handle)
    return out


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    scale_o: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """What the operator computes, in float32 from the dequantized inputs (its CPU implementation)."""
    real = [
        (x.float() * scale.float()).transpose(1, 2) for x, scale in ((q, descale_q), (k, descale_k), (v, descale_v))
    ]
    scores = (real[0] @ real[1].transpose(-1, -2)) * softmax_scale
    out = scores.softmax(dim=-1) @ real[2]
    return (out.transpose(1, 2) * scale_o.float()).clamp(-FP8_MAX, FP8_MAX).to(q.dtype).contiguous()


# cuDNN on CUDA, ``reference`` on the CPU; compiled graphs see an fp8 tensor shaped like q.
_operator = torch.library.custom_op("vidq::cudnn_fp8_attention", mutates_args=(), schema=SCHEMA)(_run)
_operator.register_kernel("cpu")(reference)
_operator.register_fake(lambda q, *args: q.new_empty(q.shape))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Softmax attention of (batch, tokens, heads, head_dim) q, k, v (bf16 or fp16) on cuDNN's fp8 kernel, in q's
    dtype and shape. Each of q, k and v gets one scale, its largest magnitude mapped to e4m3's largest value. K is
    smoothed first: its mean over the tokens (per batch, head and channel) is subtracted, which shifts every score
    of a query by the same amount and so leaves the softmax unchanged, while it takes the shared offset out of what
    8 bits must hold. The output's scale is V's: no output row can exceed V's largest magnitude."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kf = k.float()
    smoothed = kf - kf.mean(dim=1, keepdim=True)
    descale = [_descale(x) for x in (q, smoothed, v)]
    q8, k8, v8 = ((x.float() / d).to(torch.float8_e4m3fn) for x, d in zip((q, smoothed, v), descale, strict=True))
    out: torch.Tensor = torch.ops.vidq.cudnn_fp8_attention(q8, k8, v8, *descale, 1 / descale[2], scale)
    return (out.float() * descale[2]).to(q.dtype)


def _descale(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale (shaped 1, 1, 1, 1, as cuDNN takes it) that maps ``x``'s largest magnitude to e4m3's."""
    return (x.abs().amax().float().clamp(min=1e-12) / FP8_MAX).reshape(1, 1, 1, 1)
