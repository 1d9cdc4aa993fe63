"""8-bit matrix products for a tier's Linear layers (torchao), with the fallback when a format cannot run here.

Two formats, each a torchao configuration applied to the layers a tier's table names:

* ``fp8_e4m3_rowwise`` — weights quantized once to float8 (e4m3) with one scale per output row; activations
  quantized to float8 on the fly, one scale per row (token), so one outlier token costs no other its precision. The
  product runs on the GPU's fp8 tensor cores (``torch._scaled_mm``) with bf16 output; under compiled blocks the
  activations' quantization fuses into the kernels before it. Needs compute capability 8.9 or newer (Ada, Hopper,
  Blackwell).
* ``int8_weight_only`` — weights stored in int8 with one scale per output row, dequantized inside the product;
  activations stay in the compute dtype. It halves the layers' weight memory and runs on any device; on a large
  product it is no faster than bf16 (the product is compute-bound, not weight-bound).

``resolve`` turns what the table asks for into what runs on this device: "linear8" (the table's word for "the
device's 8-bit format") becomes fp8 where the GPU has fp8 tensor cores and int8 weight-only elsewhere; a format
that cannot run (an unknown name, torchao not installed, fp8 on a GPU without it) falls back to the next one that
can, down to the compute dtype, with a log line and the reason kept for the job's result.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger("vidq.render")

FP8_ROWWISE = "fp8_e4m3_rowwise"
INT8_WEIGHT_ONLY = "int8_weight_only"
EIGHT_BIT = "linear8"  # in a tier's table: this device's 8-bit format for the layer
FORMATS = (FP8_ROWWISE, INT8_WEIGHT_ONLY)  # the 8-bit formats, fastest first: each falls back to the next
FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a table's format became on this device: the format that runs, and why it is not the one asked for."""

    asked: str
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
    if not torchao_installed():
        return "torchao is not installed (pip install 'vidq[worker]')"
    if fmt == FP8_ROWWISE:
        if device.type != "cuda":
            return f"fp8 products run on CUDA GPUs only, not {device.type}"
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            return f"fp8 tensor cores need compute capability 8.9 or newer, not {capability[0]}.{capability[1]}"
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
    return Resolved(asked, runs, "; ".join(notes + failed) or None)


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return f"the {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


@functools.cache
def _log_fallback(asked: str, runs: str, reason: str) -> None:
    log.warning("8-bit format not available; falling back", extra={"asked": asked, "runs": runs, "reason": reason})


@functools.cache
def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def quantize_linears(module: torch.nn.Module, formats: dict[str, str]) -> Counter[str]:
    """Quantize ``module``'s Linear layers named in ``formats`` (dotted name within ``module`` → a format of
    ``FORMATS``; "compute" leaves the layer as it is). Returns how many layers each format got."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    configs = {
        FP8_ROWWISE: lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        INT8_WEIGHT_ONLY: Int8WeightOnlyConfig,
    }
    counts: Counter[str] = Counter()
    for fmt, make in configs.items():
        names = {name for name, wanted in formats.items() if wanted == fmt}
        if names:
            quantize_(module, make(), filter_fn=lambda layer, name, names=names: _is_linear(layer) and name in names)
            counts[fmt] = len(names)
    return counts


def linear_layers(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Linear]]:
    """``module``'s Linear layers by dotted name."""
    for name, layer in module.named_modules():
        if _is_linear(layer):
            assert isinstance(layer, torch.nn.Linear)
            yield name, layer


def _is_linear(layer: torch.nn.Module) -> bool:
    return type(layer) is torch.nn.Linear
