"""Prompt text to embeddings: the text encoder on its own, and the identity its embeddings are cached under.

A Wan pipeline encodes a prompt by tokenizing it to ``MAX_SEQUENCE_LENGTH`` (512) tokens, running UMT5 over them and
zeroing every row past the prompt's real tokens. ``TextEncoder.encode`` does exactly that but keeps only the real
rows, shape (n, hidden): what the embedding cache stores (a 20-token prompt is 20 rows, not 512). ``pad`` turns
them back into the (batch, 512, hidden) tensor the transformer takes, equal to ``WanPipeline.encode_prompt``'s own
output (tests/shared/render/test_text.py checks bit equality).

``EncoderIdentity`` names what an embedding depends on: the model, the encoder's configuration and tokenizer (a
fingerprint), the sequence length and the dtype. A worker without a text encoder (``VIDQ_WORKER_TEXT_ENCODER=
remote``) computes the same identity from configuration alone, so it finds what the prewarmer stored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase, UMT5EncoderModel

from shared.render.architectures import (
    TINY_WAN,
    TINY_WAN_BUILD,
    WAN21_13B_ARCH,
    WAN21_BUILD,
    build_tiny_wan_text_encoder,
    build_wan21_text_encoder,
    tiny_wan_text_config,
    wan21_text_config,
)
from shared.render.precision import dtype_name
from shared.render.tokenizer import build_tokenizer

MAX_SEQUENCE_LENGTH = 512  # what WanPipeline.__call__ uses; encode_prompt's own default (226) differs
LOCAL = "local"  # served from settings.model_dir


@dataclass(frozen=True, slots=True)
class EncoderIdentity:
    """Everything a prompt's embedding depends on besides its text. Two processes with equal identities produce
    interchangeable embeddings (up to their devices' kernel rounding)."""

    model: str
    fingerprint: str  # sha256 of the encoder's configuration, weights' origin and tokenizer
    max_sequence_length: int
    dtype: str  # "bfloat16", "float16", "float32": the dtype the embeddings are computed and stored in
    hidden_size: int  # the width of one row

    def key(self, text: str) -> str:
        """The cache key of ``text``'s embedding: sha256 of (model, fingerprint, length, dtype, text)."""
        fields = [self.model, self.fingerprint, str(self.max_sequence_length), self.dtype, text]
        return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]


def _fingerprint(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()


def encoder_identity(model: str, *, dtype: torch.dtype, model_dir: str | None = None) -> EncoderIdentity:
    """The identity ``model``'s embeddings have in ``dtype``, read from configuration only (no weights loaded)."""
    if model in (TINY_WAN, WAN21_13B_ARCH):
        tokenizer = build_tokenizer()
        config = tiny_wan_text_config(len(tokenizer)) if model == TINY_WAN else wan21_text_config()
        build = TINY_WAN_BUILD if model == TINY_WAN else WAN21_BUILD  # seeded random weights: the build is the origin
        fingerprint = _fingerprint(build, config.to_json_string(use_diff=False), _tokenizer_fingerprint(tokenizer))
        return EncoderIdentity(model, fingerprint, MAX_SEQUENCE_LENGTH, dtype_name(dtype), config.d_model)
    source = _source(model, model_dir)
    config = AutoConfig.from_pretrained(source, subfolder="text_encoder", local_files_only=Path(source).is_dir())
    # A hub snapshot names its revision; a folder is identified by its configuration and tokenizer files.
    revision = str(getattr(config, "_commit_hash", None) or "")
    tokenizer_files = sorted(Path(source, "tokenizer").glob("*")) if Path(source).is_dir() else []
    tokenizer_digest = hashlib.sha256(b"".join(f.read_bytes() for f in tokenizer_files if f.is_file())).hexdigest()
    fingerprint = _fingerprint(source, revision, config.to_json_string(use_diff=False), tokenizer_digest)
    return EncoderIdentity(model, fingerprint, MAX_SEQUENCE_LENGTH, dtype_name(dtype), int(config.d_model))


def _source(model: str, model_dir: str | None) -> str:
    if model == LOCAL:
        if not model_dir:
            raise ValueError("model 'local' needs settings.model_dir (VIDQ_MODEL_DIR)")
        return model_dir
    return model


class TextEncoder:
    """A tokenizer and text encoder on a device: prompts in, their real-token embedding rows out."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, encoder: torch.nn.Module, *, identity: EncoderIdentity
    ) -> None:
        self.tokenizer = tokenizer
        self.encoder: Any = encoder  # a transformers encoder: called with (ids, mask)
        self.identity = identity

    @property
    def device(self) -> torch.device:
        """Where its inputs go: where its weights are (the VRAM pool may move them), or, for an offloaded encoder
        (registry.WholeModuleOffload) whose weights wait on the CPU between calls, where they are copied to."""
        onload: torch.device | None = getattr(self.encoder, "vidq_onload_device", None)
        return onload or next(self.encoder.parameters()).device

    def encode(self, texts: list[str], *, batch_size: int = 1) -> list[torch.Tensor]:
        """One (n_i, hidden) tensor per text, on the CPU, in ``identity.dtype``: the rows ``WanPipeline`` keeps
        before zero-padding to 512 (tokenized and encoded the way ``WanPipeline._get_t5_prompt_embeds`` does).

        ``batch_size`` 1 (a worker) gives exactly what ``encode_prompt`` gives, which encodes one text per call,
        padded to 512 tokens. Larger batches (the prewarmer, a batch of renders) are packed: the texts are sorted by
        token count and each batch is padded only to its longest text, so short prompts do not pay for 512 tokens
        each. The padding is masked out, so the rows equal the single-text ones up to the kernels' rounding for
        another batch shape; they come back in the order asked."""
        size = max(1, batch_size)
        if size == 1:
            return [row for text in texts for row in self._encode_batch([text], pad_to_max=True)]
        order = sorted(range(len(texts)), key=lambda i: self._token_count(texts[i]))
        out: list[torch.Tensor | None] = [None] * len(texts)
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for index, row in zip(chunk, self._encode_batch([texts[i] for i in chunk], pad_to_max=False), strict=True):
                out[index] = row
        return [row for row in out if row is not None]

    def _token_count(self, text: str) -> int:
        ids = self.tokenizer(
            prompt_clean(text), truncation=True, max_length=self.identity.max_sequence_length, add_special_tokens=True
        ).input_ids
        return len(ids)

    @torch.inference_mode()
    def _encode_batch(self, texts: list[str], *, pad_to_max: bool) -> list[torch.Tensor]:
        inputs = self.tokenizer(
            [prompt_clean(t) for t in texts],
            padding="max_length" if pad_to_max else "longest",
            max_length=self.identity.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids, inputs.attention_mask
        lengths = mask.gt(0).sum(dim=1).long().tolist()
        hidden = self.encoder(ids.to(self.device), mask.to(self.device)).last_hidden_state
        hidden = hidden.to(dtype=self.identity.torch_dtype)
        return [row[:n].to("cpu").contiguous() for row, n in zip(hidden, lengths, strict=True)]


def texts_of(prompt: str, negative_prompt: str, guidance_scale: float) -> tuple[str, ...]:
    """The texts a render encodes: WanPipeline encodes the negative prompt only when guidance > 1 (classifier-free
    guidance on), and an empty negative prompt is still encoded then."""
    return (prompt, negative_prompt) if guidance_scale > 1.0 else (prompt,)


def pad(rows: list[torch.Tensor], *, max_sequence_length: int, device: torch.device) -> torch.Tensor:
    """(n_i, hidden) tensors to one (batch, max_sequence_length, hidden) tensor on ``device``, zero past each n_i:
    the embeddings ``WanPipeline.encode_prompt`` would have produced."""
    out = torch.zeros(len(rows), max_sequence_length, rows[0].shape[1], dtype=rows[0].dtype, device=device)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row.to(device, non_blocking=True)
    return out


def build_text_encoder(
    model: str, *, device: torch.device, dtype: torch.dtype, model_dir: str | None = None
) -> TextEncoder:
    """Only the tokenizer and text encoder of ``model``, on ``device`` (the prewarmer; no transformer, no VAE)."""
    identity = encoder_identity(model, dtype=dtype, model_dir=model_dir)
    if model == TINY_WAN:
        tokenizer: PreTrainedTokenizerBase = build_tokenizer()
        encoder: torch.nn.Module = build_tiny_wan_text_encoder(device=device, dtype=dtype)
    elif model == WAN21_13B_ARCH:
        tokenizer = build_tokenizer()
        encoder = build_wan21_text_encoder(device=device, dtype=dtype)
    else:
        source = _source(model, model_dir)
        local = Path(source).is_dir()
        tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer", local_files_only=local)
        encoder = UMT5EncoderModel.from_pretrained(
            source, subfolder="text_encoder", dtype=dtype, local_files_only=local
        )
        encoder.to(device)  # type: ignore[arg-type]  # transformers types .to() for its own arguments only
    encoder.eval()
    return TextEncoder(tokenizer, encoder, identity=identity)


def pipeline_text_encoder(pipe: Any, identity: EncoderIdentity) -> TextEncoder | None:
    """The text encoder a built pipeline already holds (a local-encoder worker), or None when it was built without."""
    if getattr(pipe, "text_encoder", None) is None:
        return None
    return TextEncoder(pipe.tokenizer, pipe.text_encoder, identity=identity)
