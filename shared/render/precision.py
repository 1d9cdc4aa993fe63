"""Device and precision policy: which device and compute dtype a pipeline runs in, and how its weights are cast.

Compute in bf16 on CUDA (fp16 where bf16 is missing), float32 on the CPU (docs/architecture.md, "Rendering"). A
pipeline's VAE is built in float32, as Wan's reference code and diffusers' Wan examples run it; a precision tier may
decode in bf16 (shared/render/tiers.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

# The compute dtypes a pipeline may run in, by the names settings and cache keys use.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(pref: str | None, *, cuda_dtype: str) -> tuple[torch.device, torch.dtype]:
    """Pick the device and compute dtype: CUDA in ``cuda_dtype`` (fp16 where bf16 is missing), else CPU in float32.

    ``pref`` is ``settings.device`` ("cuda", "cuda:1", "cpu" or None for "CUDA if there is one"); ``cuda_dtype``
    is ``settings.cuda_dtype`` ("bfloat16" or "float16"), passed in by the process's entry point.
    """
    if pref is None:
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(pref)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {pref!r} was asked for but CUDA is not available")
    return device, compute_dtype(device, cuda_dtype=cuda_dtype)


def compute_dtype(device: torch.device, *, cuda_dtype: str) -> torch.dtype:
    """The dtype a pipeline on ``device`` computes in: the one rule for workers and for the prewarmer that encodes
    for them (their embeddings are cached under it: if the two differed, no lookup would ever hit). float32 off
    CUDA (CPU half precision is slow and poorly covered by kernels); on CUDA ``cuda_dtype``, fp16 where this process
    sees a GPU without bf16 (a GPU it cannot see, as for a prewarmer on a CPU node, is taken to have it)."""
    if device.type != "cuda":
        return torch.float32
    if cuda_dtype == "bfloat16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype_from_name(cuda_dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name results, logs and cache keys carry."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The compute dtype called ``name`` (a key of ``DTYPES``)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown compute dtype {name!r}; expected one of {sorted(DTYPES)}") from None


@contextmanager
def materialise_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors go to ``device``, with ``dtype`` as the default float type until the block ends."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def text_encoder_fp32_modules(model: torch.nn.Module, dtype: torch.dtype) -> Collection[str]:
    """The modules of a transformers text encoder that ``from_pretrained(dtype=dtype)`` would keep in fp32."""
    # transformers keeps T5's "wo" in fp32 only for fp16, where its activations overflow; bf16 has the range.
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return keep


def cast_like_from_pretrained(module: torch.nn.Module, dtype: torch.dtype, *, keep_fp32: Collection[str]) -> None:
    """Cast floating tensors to ``dtype`` as ``from_pretrained`` does: names in ``keep_fp32`` go to fp32.

    A tensor's name matches a listed module when one of its dotted parts equals it (``blocks.0.norm2.weight``
    matches ``norm2``).
    """
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point():
            target = torch.float32 if set(name.split(".")) & set(keep_fp32) else dtype
            if tensor.dtype != target:
                tensor.data = tensor.data.to(target)
