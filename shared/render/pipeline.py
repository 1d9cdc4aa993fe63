"""Render one video from a ``GenerationSpec``: the plain function a worker task calls.

``VideoPipeline`` wraps a Wan-family diffusers pipeline (``WanPipeline`` or one with its interface:
``encode_prompt``, a ``vae`` with ``latents_mean``/``latents_std``, a ``video_processor``) and runs it in
separate, timed stages, so a worker can report real step progress, stop a cancelled job between steps and,
later, reuse cached prompt embeddings.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline  # the root re-exports a placeholder to mypy

from shared.render.precision import dtype_name
from shared.render.text import (
    MAX_SEQUENCE_LENGTH,
    EncoderIdentity,
    encoder_identity,
    pad,
    pipeline_text_encoder,
    texts_of,
)
from shared.spec import GenerationSpec

StepCallback = Callable[[int, int], None]
# Texts to their real-token embedding rows (shared/render/text.py): the worker passes the embedding cache's lookup.
TextRows = Callable[[list[str]], list[torch.Tensor]]
# Around each stage ("embeddings", "denoise", "decode"), ended once the stage's device work is done: the worker passes
# a span (shared/tracing.py).
StageScope = Callable[[str], AbstractContextManager[Any]]


class PermanentRenderError(Exception):
    """The model rejected the input itself: retrying the same job cannot succeed."""


class RenderOutOfMemory(Exception):
    """The GPU ran out of memory for this job even in ``low_vram`` mode: this GPU cannot render this shape."""


@dataclass(frozen=True, slots=True)
class RenderResult:
    frames: np.ndarray  # uint8, (frames, height, width, 3)
    timings_s: dict[str, float]  # encode_text, denoise, decode, total
    peak_vram_bytes: int | None  # None off CUDA
    device: str
    dtype: str


class VideoPipeline:
    """A built diffusers pipeline kept warm on its device, with ``generate`` as its one entry point."""

    def __init__(
        self,
        pipe: DiffusionPipeline,
        *,
        model: str,
        device: torch.device,
        dtype: torch.dtype,
        identity: EncoderIdentity | None = None,
        memory_mode: str = "resident",
    ) -> None:
        for attribute in ("encode_prompt", "vae", "video_processor"):
            if not hasattr(pipe, attribute):
                name = type(pipe).__name__
                raise TypeError(f"{name} has no {attribute!r}: not a Wan-family video pipeline")
        # Any: diffusers pipelines share no typed call interface; the Wan one was checked above.
        self.pipe: Any = pipe
        self.model = model
        self.device = device
        self.dtype = dtype
        self.memory_mode = memory_mode  # shared/render/registry.py apply_memory_mode
        # What its prompt embeddings are cached under; from the model's configuration unless given.
        self.identity = identity or encoder_identity(model, dtype=dtype)
        self.encoder = pipeline_text_encoder(pipe, self.identity)  # None: built without one (remote text encoding)

    def encode_texts(self, texts: list[str]) -> list[torch.Tensor]:
        """Encode with the pipeline's own text encoder, one text at a time as ``encode_prompt`` does."""
        if self.encoder is None:
            raise RuntimeError(f"{self.model} was built without its text encoder: embeddings must come from elsewhere")
        return self.encoder.encode(texts)

    def generate(
        self,
        spec: GenerationSpec,
        *,
        on_step: StepCallback | None = None,
        text_rows: TextRows | None = None,
        stage_scope: StageScope | None = None,
    ) -> RenderResult:
        """Render ``spec`` to uint8 RGB frames.

        ``text_rows`` gives the prompt's (and negative prompt's) embedding rows; by default the pipeline's own
        encoder computes them. ``stage_scope(name)`` wraps each stage ("embeddings", "denoise", "decode").
        ``on_step(done, total)`` runs after every denoising step. Whatever it raises (a cancelled job's
        ``JobCancelled``) stops the render at once and propagates unchanged; its intermediate tensors are released
        before the exception leaves. A ``ValueError`` from the model becomes ``PermanentRenderError``.
        """
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        from_on_step: list[BaseException] = []  # tells on_step's own errors apart from the model's
        timings: dict[str, float] = {}
        try:
            frames = self._render(
                spec,
                text_rows or self.encode_texts,
                on_step=on_step,
                from_on_step=from_on_step,
                timings=timings,
                scope=stage_scope or _no_scope,
            )
        except BaseException as exc:
            # The traceback pins every frame it passed through, and with them the latents, embeddings and
            # activations. Drop those frames' locals now so the memory goes back to the device while the
            # caller is still handling the exception (it may keep it, e.g. to log it later). This function's
            # own frame holds no tensors: the stages live in _render for that reason.
            _release_locals(exc.__traceback__)
            if isinstance(exc, ValueError) and not (from_on_step and exc is from_on_step[0]):
                raise PermanentRenderError(str(exc)) from exc
            raise
        finally:
            if cuda:
                torch.cuda.empty_cache()  # a long-lived worker must not keep a cancelled job's blocks cached
        return RenderResult(
            frames=frames,
            timings_s=timings,
            peak_vram_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None,
            device=str(self.device),
            dtype=dtype_name(self.dtype),
        )

    def _render(
        self,
        spec: GenerationSpec,
        text_rows: TextRows,
        *,
        on_step: StepCallback | None,
        from_on_step: list[BaseException],
        timings: dict[str, float],
        scope: StageScope,
    ) -> np.ndarray:
        with torch.inference_mode():
            started = stage = self._clock()

            # 1. Encode the prompt (and the negative prompt when classifier-free guidance is on).
            with scope("embeddings"):
                prompt_embeds, negative_embeds = self._encode_text(spec, text_rows)
                timings["encode_text"], stage = self._lap(stage)

            # 2. Denoise in latent space, reporting each step.
            with scope("denoise"):
                latents = self._denoise(spec, prompt_embeds, negative_embeds, on_step, from_on_step)
                timings["denoise"], stage = self._lap(stage)

            # 3. Decode the latents to pixels with the VAE.
            with scope("decode"):
                video = self._decode(latents)
                timings["decode"], stage = self._lap(stage)

            # 4. Convert to uint8 frames, (F, H, W, 3).
            frames = _to_uint8(video)
            timings["total"] = self._clock() - started
        return frames

    def _encode_text(self, spec: GenerationSpec, text_rows: TextRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (1, 512, hidden) embeddings ``encode_prompt`` would give: the rows zero-padded to 512."""
        texts = list(texts_of(spec.prompt, spec.negative_prompt, spec.guidance_scale))
        embeds = pad(text_rows(texts), max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device)
        return embeds[:1], (embeds[1:2] if len(texts) == 2 else None)

    def _denoise(
        self,
        spec: GenerationSpec,
        prompt_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        on_step: StepCallback | None,
        from_on_step: list[BaseException],
    ) -> torch.Tensor:
        def step_end(pipe: Any, step_index: int, _timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if on_step is not None:
                try:
                    # The scheduler's step count, not spec.steps: a higher-order scheduler takes more.
                    on_step(step_index + 1, pipe.num_timesteps)
                except BaseException as exc:
                    from_on_step.append(exc)
                    raise
            return tensors  # handed back unchanged: the pipeline reads its latents from the returned dict

        # The generator lives on the pipeline's device: a seed gives the same noise as a plain diffusers call.
        generator = torch.Generator(device=self.device).manual_seed(spec.seed)
        (latents,) = self.pipe(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_embeds,
            height=spec.height,
            width=spec.width,
            num_frames=spec.num_frames,
            num_inference_steps=spec.steps,
            guidance_scale=spec.guidance_scale,
            generator=generator,
            output_type="latent",
            return_dict=False,
            callback_on_step_end=step_end,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        latents_out: torch.Tensor = latents
        return latents_out

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(device=vae.device, dtype=vae.dtype)
        # Undo the per-channel normalisation the transformer works in, exactly as WanPipeline does.
        shape = (1, vae.config.z_dim, 1, 1, 1)
        # Kept as WanPipeline writes it (divide by 1/std) so the frames match a plain call bit for bit.
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        # "pt" keeps the frames on the device: the uint8 conversion then runs there, and only a quarter of the
        # bytes (uint8, not float32) cross to the host.
        frames: torch.Tensor = self.pipe.video_processor.postprocess_video(video, output_type="pt")
        return frames

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run ahead of Python: wait before reading the time
        return time.perf_counter()

    def _lap(self, since: float) -> tuple[float, float]:
        now = self._clock()
        return now - since, now


def _no_scope(_stage: str) -> AbstractContextManager[None]:
    return nullcontext()


def _release_locals(tb: TracebackType | None) -> None:
    """Drop the local variables of every finished frame in ``tb``."""
    while tb is not None:
        frame = tb.tb_frame
        try:
            frame.clear()
        except RuntimeError:
            pass  # still executing (generate's own frame): it holds no tensors
        else:
            if sys.version_info < (3, 13):
                # Before 3.13 a frame that called locals() keeps that snapshot, and clear() leaves it behind.
                # WanPipeline.__call__ does (for its step callback), and the snapshot holds the latents.
                frame.f_locals.clear()
        tb = tb.tb_next


def _to_uint8(video: torch.Tensor) -> np.ndarray:
    """(1, F, 3, H, W) floats in [0, 1] to (F, H, W, 3) uint8, rounded (half to even, as numpy's rint):
    truncation would darken every pixel. Runs on the tensor's device; one copy to the host at the end."""
    frames = (video[0].permute(0, 2, 3, 1) * 255.0).round().clamp(0, 255).to(torch.uint8)
    return np.ascontiguousarray(frames.cpu().numpy())
