"""One cached embedding as bytes: safetensors (never pickle), with its key in the metadata, checked on read.

An entry holds one tensor, ``rows``: the (n, hidden) real-token rows of one text (shared/render/text.py). Reading
checks everything a broken, truncated, misplaced or foreign entry could get wrong (format, key, dtype, rank,
width, length, finiteness); any mismatch is ``CorruptEntry``, which the cache counts, deletes and re-encodes.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shared.render.text import EncoderIdentity

FORMAT = "vidq-embedding/1"


class CorruptEntry(ValueError):
    """A stored entry that is not the embedding its key names."""


def pack(key: str, rows: torch.Tensor) -> bytes:
    return st_save({"rows": rows.contiguous()}, metadata={"format": FORMAT, "key": key})


def _metadata(raw: bytes) -> dict[str, str]:
    # safetensors layout: an 8-byte little-endian header length, then the JSON header ("__metadata__" inside).
    if len(raw) < 8:
        raise CorruptEntry("entry shorter than a safetensors header")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > len(raw) - 8:
        raise CorruptEntry("safetensors header runs past the entry")
    try:
        header = json.loads(raw[8 : 8 + size])
    except ValueError as exc:
        raise CorruptEntry("safetensors header is not JSON") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def unpack(raw: bytes, *, key: str, identity: EncoderIdentity) -> torch.Tensor:
    """The rows stored in ``raw``, or ``CorruptEntry``."""
    metadata = _metadata(raw)
    if metadata.get("format") != FORMAT or metadata.get("key") != key:
        raise CorruptEntry("entry belongs to another key or format")
    try:
        tensors = st_load(raw)
    except Exception as exc:  # safetensors raises its own SafetensorError (and others) on a broken body
        raise CorruptEntry(f"unreadable tensors: {exc}") from exc
    rows = tensors.get("rows")
    if rows is None or len(tensors) != 1:
        raise CorruptEntry("entry does not hold exactly one 'rows' tensor")
    if rows.dtype != identity.torch_dtype:
        raise CorruptEntry(f"dtype {rows.dtype} is not {identity.dtype}")
    if rows.ndim != 2 or rows.shape[1] != identity.hidden_size:
        raise CorruptEntry(f"shape {tuple(rows.shape)} is not (n, {identity.hidden_size})")
    if not 1 <= rows.shape[0] <= identity.max_sequence_length:
        raise CorruptEntry(f"{rows.shape[0]} rows, expected 1..{identity.max_sequence_length}")
    if not bool(torch.isfinite(rows).all()):
        raise CorruptEntry("non-finite values")
    return rows
