"""8-bit matrix products for a tier's Linear layers, with the fallback when a format cannot run here.

Two formats, each a module that takes the place of a Linear layer the tier's table names:

* ``fp8_e4m3_rowwise`` (``Fp8RowwiseLinear``) — weights quantized once to float8 (e4m3) with one scale per output
  row; activations quantized to float8 on the fly, one scale per row (token), so one outlier token costs no other its
  precision. The product runs on the GPU's fp8 tensor cores (``torch._scaled_mm``, the kernel torchao's float8
  layers call) with the bias added and bf16 out; under compiled blocks the activations' quantization fuses into the
  kernels before it. Needs compute capability 8.9 or newer (Ada, Hopper, Blackwell).
* ``int8_weight_only`` (``Int8WeightOnlyLinear``) — weights stored in int8 with one scale per output row, turned back
  into the compute dtype for each product; activations stay in the compute dtype. It halves the layers' weight
  memory and runs on any device; it is no faster than bf16 (the products are compute-bound, not weight-bound).

They are plain modules holding plain tensors, not tensor subclasses: torch.compile shares one graph among the
transformer's repeated blocks as it does for bf16 ones (on an H200, torch 2.11, compiling blocks whose weights were
torchao's float8 tensors had not finished after five and a half minutes).

``resolve`` turns what the table asks for into what runs on this device: "linear8" (the table's word for "the
device's 8-bit format") becomes fp8 where the GPU has fp8 tensor cores and int8 weight-only elsewhere; a format
that cannot run (an unknown name, fp8 on a device without it) falls back to the next one that can, with a log line
and the reason kept for the job's result.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger("vidq.render")

FP8_ROWWISE = "fp8_e4m3_rowwise"
INT8_WEIGHT_ONLY = "int8_weight_only"
EIGHT_BIT = "linear8"  # in a tier's table: this device's 8-bit format for the layer
FORMATS = (FP8_ROWWISE, INT8_WEIGHT_ONLY)  # the 8-bit formats, fastest first: each falls back to the next
FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
FP8_MAX = 448.0  # float8 e4m3's largest finite value


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a table's format became on this device: the format that runs, and why it is not the one asked for."""

    runs: str  # a name of FORMATS, or "compute" (the layer keeps the compute dtype)
    reason: str | None = None  # why ``runs`` differs from ``asked``


def device_format(device: torch.device) -> str:
    """This device's 8-bit format: fp8 where the GPU has fp8 tensor cores, int8 weight-only on other GPUs and on
    the CPU."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY:
        return FP8_ROWWISE
    return INT8_WEIGHT_ONLY


def unavailable(fmt: str, device: torch.device) -> str | None:
    """Why ``fmt`` cannot run on ``device``; None when it can."""
    if fmt not in FORMATS:
        return f"no 8-bit format is called {fmt!r} (known: {', '.join(FORMATS)})"
    if fmt == FP8_ROWWISE:
        if device.type != "cuda":
            return f"fp8 products run on CUDA GPUs only, not {device.type}"
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            return f"fp8 tensor cores need compute capability 8.9 or newer, not {capability[0]}.{capability[1]}"
        return _fp8_product_fails(device)
    return None


def _fp8_product_fails(device: torch.device) -> str | None:
    """Why this build of torch cannot run the product ``Fp8RowwiseLinear`` needs on ``device``; None when it can
    (tried once per process and GPU, on a small product)."""
    return _probe_fp8(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _probe_fp8(index: int) -> str | None:
    device = torch.device("cuda", index)
    try:
        probe = Fp8RowwiseLinear(torch.nn.Linear(32, 16, device=device, dtype=torch.bfloat16))
        with torch.inference_mode():
            probe(torch.ones(16, 32, device=device, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch's fp8 product failed here: {str(exc).splitlines()[0][:200]}"
    return None


def resolve(asked: str, device: torch.device) -> Resolved:
    """What ``asked`` (a format's name, or ``EIGHT_BIT``) runs as on ``device``: itself where it can, else the next
    format of ``FORMATS`` that can, else the compute dtype; each fallback logged once per process and reason.
    ``EIGHT_BIT`` is the device's own format (``device_format``): on a device without fp8 the result says why it
    is int8."""
    notes = []
    wanted = asked
    if asked == EIGHT_BIT:
        wanted = device_format(device)
        if wanted != FP8_ROWWISE:
            notes.append(f"{_describe(device)} has no fp8 tensor cores: its 8-bit format is {wanted}")
    candidates = list(FORMATS[FORMATS.index(wanted) :]) if wanted in FORMATS else [wanted, *FORMATS]
    failed = []
    runs = "compute"
    for fmt in candidates:
        reason = unavailable(fmt, device)
        if reason is None:
            runs = fmt
            break
        failed.append(f"{fmt}: {reason}")
    if failed:
        _log_fallback(asked, runs, "; ".join(failed))
    return Resolved(runs, "; ".join(notes + failed) or None)


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return f"the {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


@functools.cache
def _log_fallback(asked: str, runs: str, reason: str) -> None:
    log.warning("8-bit format not available; falling back", extra={"asked": asked, "runs": runs, "reason": reason})


def quantize_linears(module: torch.nn.Module, formats: dict[str, str]) -> dict[str, str]:
    """Put an 8-bit module in place of each of ``module``'s Linear layers named in ``formats`` (dotted name within
    ``module`` → a format of ``FORMATS``; any other value leaves the layer as it is). A layer fp8 products cannot
    take (a side not a multiple of 16) gets int8 weights instead. Returns the format each replaced layer got."""
    applied: dict[str, str] = {}
    for name, layer in list(linear_layers(module)):
        fmt = formats.get(name)
        if fmt == FP8_ROWWISE and not Fp8RowwiseLinear.fits(layer):
            fmt = INT8_WEIGHT_ONLY
        if fmt == FP8_ROWWISE:
            replacement: torch.nn.Module = Fp8RowwiseLinear(layer)
        elif fmt == INT8_WEIGHT_ONLY:
            replacement = Int8WeightOnlyLinear(layer)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, replacement)
        applied[name] = fmt
    return applied


def _rowwise(weight: torch.Tensor, largest: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (out, in) as (values / scale, scale): one float32 scale per output row, so that each row's largest
    magnitude maps to ``largest``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / largest
    return w / scale, scale


class Fp8RowwiseLinear(torch.nn.Module):
    """A Linear layer computing in fp8 with per-row scales of weights and activations (module docstring)."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor

    @staticmethod
    def fits(linear: torch.nn.Linear) -> bool:
        """Whether fp8 products can take the layer: both of its sides multiples of 16."""
        return linear.in_features % 16 == 0 and linear.out_features % 16 == 0

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        values, scale = _rowwise(linear.weight, FP8_MAX)
        self.register_buffer("weight_fp8", values.to(torch.float8_e4m3fn))  # (out, in): its transpose is column-major
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, out) float32
        self.bias = linear.bias  # in the compute dtype, added by the product's epilogue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (tokens, 1)
        quantized = (rows.float() / scale).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            quantized,
            self.weight_fp8.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={FP8_ROWWISE}"


class Int8WeightOnlyLinear(torch.nn.Module):
    """A Linear layer whose weights are stored in int8 with per-row scales (module docstring)."""

    weight_int8: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        values, scale = _rowwise(linear.weight, 127.0)
        self.register_buffer("weight_int8", values.round().to(torch.int8))  # (out, in)
        self.register_buffer("weight_scale", scale.to(linear.weight.dtype))  # (out, 1) in the compute dtype
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_int8.to(x.dtype) * self.weight_scale.to(x.dtype)
        return torch.nn.functional.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={INT8_WEIGHT_ONLY}"


def linear_layers(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Linear]]:
    """``module``'s Linear layers by dotted name."""
    for name, layer in module.named_modules():
        if _is_linear(layer):
            assert isinstance(layer, torch.nn.Linear)
            yield name, layer


def _is_linear(layer: torch.nn.Module) -> bool:
    return type(layer) is torch.nn.Linear
