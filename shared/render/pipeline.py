"""Render one video from a ``GenerationSpec``: the plain function a worker task calls.

``VideoPipeline`` wraps a Wan-family diffusers pipeline (``WanPipeline`` or one with its interface:
``encode_prompt``, a ``vae`` with ``latents_mean``/``latents_std``, a ``video_processor``) and runs it in
separate, timed stages, so a worker can report real step progress, stop a cancelled job between steps and
reuse cached prompt embeddings. It renders under a precision tier's policy (shared/render/tiers.py): built with
``eager_policy()`` it is a plain diffusers call, bit for bit; under ``exact`` its transformer blocks are compiled,
q/k/v fused and both guidance passes batched; under ``fast`` the blocks' Linear layers are 8-bit too. A job's step
cache (shared/render/step_cache.py) skips the transformer on some steps of its own denoising loop.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline  # the root re-exports a placeholder to mypy
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.render.attention import FLASH_ATTENTION_4, SDPA_PREFERENCE, flash4_unavailable, use_flash4
from shared.render.fp8_attention import FP8_KERNELS, fp8_attention_unavailable, use_fp8_attention
from shared.render.memory import MIB, DecodeBudget, DecoderGeometry, chooses_decode_tiling, decode_tiled
from shared.render.precision import dtype_name
from shared.render.quantize import EIGHT_BIT, linear_layers, quantize_linears, resolve
from shared.render.step_cache import StepPredictor, preset
from shared.render.text import (
    MAX_SEQUENCE_LENGTH,
    EncoderIdentity,
    encoder_identity,
    pad,
    pipeline_text_encoder,
    texts_of,
)
from shared.render.tiers import (
    RenderedPrecision,
    TierPolicy,
    applied_table,
    eager_policy,
    is_eight_bit,
    tensor_format,
)
from shared.render.vae import compile_decoder
from shared.spec import GenerationSpec

log = logging.getLogger("vidq.render")

RECOMPILE_LIMIT = 64  # compiled graphs per function (a shape each) before torch falls back to eager

StepCallback = Callable[[int, int], None]
# Texts to their real-token embedding rows (shared/render/text.py): the worker passes the embedding cache's lookup.
TextRows = Callable[[list[str]], list[torch.Tensor]]
# Around each stage ("embeddings", "denoise", "decode"), ended once the stage's device work is done: the worker passes
# a span (shared/infra/tracing.py).
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
    precision: RenderedPrecision  # the tier and levers that rendered it, and the attention kernel
    latents: torch.Tensor | None = None  # the denoised latents, when asked for (drift measurements)
    # Pooled latents of every 8th frame (shared/context/embedding.py), what the video's embedding is made of; None
    # where pooling failed (logged): the video does not wait for, or fail with, what describes it.
    keyframes: np.ndarray | None = None


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
        policy: TierPolicy | None = None,
        decode_budget_mb: int = 0,
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
        # Where each decode chooses between whole and tiled, its memory budget (shared/render/memory.py): low_vram on
        # CUDA, capped at decode_budget_mb (0: the free memory alone). None: the VAE decodes as built.
        self.decode_budget = (
            DecodeBudget.on(device, cap_mb=decode_budget_mb) if chooses_decode_tiling(memory_mode, device) else None
        )
        # What its prompt embeddings are cached under; from the model's configuration unless given.
        self.identity = identity or encoder_identity(model, dtype=dtype)
        self.encoder = pipeline_text_encoder(pipe, self.identity)  # None: built without one (remote text encoding)
        self.policy = policy or eager_policy()
        self.flash4 = False  # the transformer's attention runs on FlashAttention 4 (else on SDPA)
        self.fp8_attention: str | None = None  # the 8-bit kernel its self-attention runs on (fp8_attention.py)
        self.linear: tuple[dict[str, Any], ...] = ()  # the 8-bit layers: what the table asked, what runs, how many
        self._apply_policy()
        # (tokens per sample, batch) the transformer has run: compiled blocks compile for another one first (logged).
        self.rendered_shapes: set[tuple[int, int]] = set()
        self.attention = "unknown"  # the SDPA backend of the last render's self-attention
        self._attention_by_shape: dict[tuple[int, int], str] = {}
        self._reference_tones: dict[int, torch.Tensor] = {}  # per frame count: embedding.reference_tones

    def _apply_policy(self) -> None:
        """Put the policy's levers on the pipeline's own modules (once; a pipeline is built for one policy)."""
        policy, transformer = self.policy, getattr(self.pipe, "transformer", None)
        if policy.fused_qkv and transformer is not None:
            for module in transformer.modules():
                if hasattr(module, "fuse_projections"):
                    module.fuse_projections()
        if policy.eight_bit and transformer is not None:  # after the fusing: the fused projections are 8-bit too
            self.linear = self._quantize(transformer)
        if FLASH_ATTENTION_4 in policy.attention and transformer is not None:
            head_dim = transformer.config.attention_head_dim
            reason = flash4_unavailable(self.device, head_dim=head_dim, dtype=self.dtype)
            if reason is None:
                self.flash4 = use_flash4(transformer) > 0
            else:
                log.info("FlashAttention 4 not used; attention runs on SDPA", extra={"reason": reason})
        for kernel in [k for k in policy.attention if k in FP8_KERNELS]:
            # The self-attentions, on the first 8-bit kernel of the preference that runs here; the rest as above.
            if transformer is None:
                break
            head_dim = transformer.config.attention_head_dim
            reason = fp8_attention_unavailable(self.device, head_dim=head_dim, dtype=self.dtype, kernel=kernel)
            if reason is None:
                self.fp8_attention = kernel if use_fp8_attention(transformer, kernel=kernel) else None
                break
            log.warning("fp8 attention not used; falling back", extra={"kernel": kernel, "reason": reason})
        if policy.compile_blocks and transformer is not None:
            # Static shapes: each (tokens, batch) gets its own kernels, compiled once and kept in the compile cache.
            _raise_recompile_limit()
            transformer.compile_repeated_blocks(fullgraph=True, dynamic=False, mode=policy.compile_mode)
        vae_dtype = getattr(torch, policy.vae_dtype)
        if self.pipe.vae.dtype != vae_dtype:
            self.pipe.vae.to(vae_dtype)
        if policy.compile_vae:
            _raise_recompile_limit()
            compile_decoder(self.pipe.vae)

    def _quantize(self, transformer: torch.nn.Module) -> tuple[dict[str, Any], ...]:
        """The transformer's Linear layers that the tier's table gives an 8-bit format, in the format that runs on
        this device (shared/render/quantize.py): what each asked format became, and for how many layers."""
        asked = {  # each layer's row of the table, its format's name as written there ("linear8": the policy's)
            name: tensor_format(self.policy.name, f"transformer.{name}.weight", compute="compute", vae="vae")
            for name, _ in linear_layers(transformer)
        }
        asked = {name: self.policy.eight_bit if fmt == EIGHT_BIT else fmt for name, fmt in asked.items()}
        resolved = {fmt: resolve(fmt, self.device) for fmt in sorted(set(asked.values())) if is_eight_bit(fmt)}
        applied = quantize_linears(transformer, {n: resolved[f].runs for n, f in asked.items() if f in resolved})
        records = []
        for fmt, outcome in resolved.items():
            ran = Counter(applied.get(name, "compute") for name, f in asked.items() if f == fmt)
            for runs, layers in sorted(ran.items(), key=lambda item: -item[1]):
                record: dict[str, Any] = {"asked": fmt, "runs": runs, "layers": layers}
                if runs != outcome.runs:
                    record["reason"] = "their sides are not multiples of 16, as fp8 products need"
                elif outcome.reason:
                    record["reason"] = outcome.reason
                records.append(record)
        return tuple(records)

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
        keep_latents: bool = False,
    ) -> RenderResult:
        """Render ``spec`` to uint8 RGB frames.

        ``text_rows`` gives the prompt's (and negative prompt's) embedding rows; by default the pipeline's own
        encoder computes them. ``stage_scope(name)`` wraps each stage ("embeddings", "denoise", "decode").
        ``keep_latents`` returns the denoised latents too. ``on_step(done, total)`` runs after every denoising
        step. Whatever it raises (a cancelled job's ``JobCancelled``) stops the render at once and propagates
        unchanged; its intermediate tensors are released before the exception leaves. A ``ValueError`` from the
        model becomes ``PermanentRenderError``.
        """
        from_on_step: list[BaseException] = []  # tells on_step's own errors apart from the model's
        timings: dict[str, float] = {}
        kept: list[torch.Tensor] = []
        keyframes: list[np.ndarray | None] = []
        cached: dict[str, Any] = {}
        with self._device_render(from_on_step):
            frames = self._render(
                spec,
                text_rows or self.encode_texts,
                on_step=on_step,
                from_on_step=from_on_step,
                timings=timings,
                cached=cached,
                scope=stage_scope or _no_scope,
                kept=kept if keep_latents else None,
                keyframes=keyframes,
            )
        return RenderResult(
            frames=frames,
            timings_s=timings,
            peak_vram_bytes=self._peak_vram(),
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            precision=self.rendered_precision(step_cache=cached),
            latents=kept[0] if kept else None,
            keyframes=keyframes[0] if keyframes else None,
        )

    def generate_batch(
        self,
        specs: list[GenerationSpec],
        *,
        on_steps: list[StepCallback],
        text_rows: TextRows | None = None,
        stage_scope: StageScope | None = None,
    ) -> list[RenderResult | Exception]:
        """Render compatible specs (``GenerationSpec.batch_key``: model, tier, shape, steps and guidance alike)
        in one denoising loop: the transformer runs once per step on every member's rows. Each member keeps its own
        seed (its own noise, drawn as a render of it alone draws it), prompts and ``on_steps`` callback.

        A member's callback that raises drops that member: its exception is its result, the others go on (the loop
        ends early once every member is dropped). Anything else — the model's errors, out of memory — fails the
        whole batch, as ``generate`` fails."""
        if len({tuple(spec.batch_key().items()) for spec in specs}) != 1:
            raise ValueError("a batch renders specs of one batch_key only")
        if not _plain_wan_loop(self.pipe):
            raise ValueError(f"{self.model} denoises with diffusers' own loop: it renders one video at a time")
        dropped: dict[int, Exception] = {}  # a member's callback's own errors never leave _render_many
        timings: dict[str, float] = {}
        cached: dict[str, Any] = {}
        with self._device_render([]):
            frames, decode_s, keyframes = self._render_many(
                specs,
                text_rows or self.encode_texts,
                on_steps=on_steps,
                dropped=dropped,
                timings=timings,
                cached=cached,
                scope=stage_scope or _no_scope,
            )
        peak = self._peak_vram()
        results: list[RenderResult | Exception] = []
        for index, member in enumerate(frames):
            if member is None:
                results.append(dropped[index])
                continue
            own = {**timings, "decode": decode_s[index], "batch": float(len(specs))}
            own["total"] = timings["total_shared"] + decode_s[index]
            del own["total_shared"]
            results.append(
                RenderResult(
                    frames=member,
                    timings_s=own,
                    peak_vram_bytes=peak,
                    device=str(self.device),
                    dtype=dtype_name(self.dtype),
                    precision=self.rendered_precision(step_cache=cached),
                    keyframes=keyframes[index],
                )
            )
        return results

    def _render_many(
        self,
        specs: list[GenerationSpec],
        text_rows: TextRows,
        *,
        on_steps: list[StepCallback],
        dropped: dict[int, Exception],
        timings: dict[str, float],
        cached: dict[str, Any],
        scope: StageScope,
    ) -> tuple[list[np.ndarray | None], list[float], list[np.ndarray | None]]:
        with self._kernels():
            started = stage = self._clock()
            with scope("embeddings"):
                per_member = [list(texts_of(s.prompt, s.negative_prompt, s.guidance_scale)) for s in specs]
                rows = text_rows([text for texts in per_member for text in texts])
                width = len(per_member[0])
                embeds = pad(rows, max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device)
                prompt_embeds = embeds[0::width]
                negative_embeds = embeds[1::width] if width == 2 else None
                timings["encode_text"], stage = self._lap(stage)

            def after_step(done: int, total: int) -> bool:
                for index, report in enumerate(on_steps):
                    if index not in dropped:
                        try:
                            report(done, total)
                        except Exception as exc:  # this member stops here; the others go on
                            dropped[index] = exc
                return len(dropped) < len(specs)

            with scope("denoise"):
                self._note_shape(specs[0], guided=negative_embeds is not None, members=len(specs))
                latents = self._denoise_many(specs, prompt_embeds, negative_embeds, after_step, cached)
                timings["denoise"], stage = self._lap(stage)
            timings["total_shared"] = stage - started
            keyframes = [self._keyframes(spec.num_frames, latents[i]) for i, spec in enumerate(specs)]

            # One VAE call for every member still in the batch (the VAE is mostly per-call overhead at small
            # shapes); each member is charged its share of it.
            active = [index for index in range(len(specs)) if index not in dropped]
            frames: list[np.ndarray | None] = [None] * len(specs)
            decode_s = [0.0] * len(specs)
            if active:
                with scope("decode"):
                    video = self._decode(latents[active] if len(active) < len(specs) else latents, timings)
                    for row, index in enumerate(active):
                        frames[index] = _to_uint8(video[row : row + 1])
                    seconds, stage = self._lap(stage)
                for index in active:
                    decode_s[index] = seconds / len(active)
        return frames, decode_s, keyframes

    def _keyframes(self, num_frames: int, latents: torch.Tensor) -> np.ndarray | None:
        """The pooled keyframes of one video's denoised latents (a few kilobytes brought to the host), or None."""
        from shared.context.embedding import keyframe_features, reference_tones

        try:
            reference = self._reference_tones.get(num_frames)
            if reference is None:
                with torch.no_grad():
                    reference = self._reference_tones[num_frames] = reference_tones(self.pipe.vae, num_frames)
            ratio = int(self.pipe.vae_scale_factor_temporal)
            return keyframe_features(latents, num_frames=num_frames, temporal_ratio=ratio, reference=reference)
        except Exception:
            log.warning("keyframe pooling failed; the video goes on without an embedding", exc_info=True)
            return None

    @contextmanager
    def _device_render(self, own_errors: list[BaseException]) -> Iterator[None]:
        """Around one render (a video or a batch): the device's peak memory is counted from here (``_peak_vram``);
        a ``ValueError`` of the model (not one in ``own_errors``, the callbacks' own) becomes
        ``PermanentRenderError``; and on the way out the device's cached blocks go back."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        except BaseException as exc:
            # The traceback pins every frame it passed through, and with them the latents, embeddings and
            # activations. Drop those frames' locals now so the memory goes back to the device while the
            # caller is still handling the exception (it may keep it, e.g. to log it later). The callers' own
            # frames hold no tensors: the stages live in _render and _render_many for that reason.
            _release_locals(exc.__traceback__)
            if isinstance(exc, ValueError) and not (own_errors and exc is own_errors[0]):
                raise PermanentRenderError(str(exc)) from exc
            raise
        finally:
            if cuda:
                torch.cuda.empty_cache()  # a long-lived worker must not keep a cancelled job's blocks cached

    def _peak_vram(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    @contextmanager
    def _kernels(self) -> Iterator[None]:
        """Inference mode, with the policy's attention kernels in its order of preference."""
        backends = [getattr(SDPBackend, name) for name in self.policy.attention if name in SDPA_PREFERENCE]
        with torch.inference_mode(), sdpa_kernel(backends, set_priority=True):
            yield

    def rendered_precision(self, *, step_cache: dict[str, Any] | None = None) -> RenderedPrecision:
        """What a result says about this pipeline's numbers (the job's request is added by the caller), and about a
        render's step cache (``StepPredictor.record``)."""
        compute, vae = dtype_name(self.dtype), self.policy.vae_dtype
        ran = {record["asked"]: record["runs"] for record in self.linear}
        return RenderedPrecision(
            requested=None,
            tier=self.policy.name,
            policy=self.policy.describe(),
            compute_dtype=compute,
            attention=self.attention,
            modules=applied_table(self.policy.name, compute=compute, vae=vae, ran=ran),
            linear=self.linear,
            step_cache=step_cache or None,
        )

    def _render(
        self,
        spec: GenerationSpec,
        text_rows: TextRows,
        *,
        on_step: StepCallback | None,
        from_on_step: list[BaseException],
        timings: dict[str, float],
        cached: dict[str, Any],
        scope: StageScope,
        kept: list[torch.Tensor] | None = None,
        keyframes: list[np.ndarray | None] | None = None,
    ) -> np.ndarray:
        with self._kernels():
            started = stage = self._clock()

            # 1. Encode the prompt (and the negative prompt when classifier-free guidance is on).
            with scope("embeddings"):
                prompt_embeds, negative_embeds = self._encode_text(spec, text_rows)
                timings["encode_text"], stage = self._lap(stage)

            # 2. Denoise in latent space, reporting each step.
            with scope("denoise"):
                latents = self._denoise(spec, prompt_embeds, negative_embeds, on_step, from_on_step, cached)
                timings["denoise"], stage = self._lap(stage)
                if kept is not None:
                    kept.append(latents)
                if keyframes is not None:
                    keyframes.append(self._keyframes(spec.num_frames, latents))

            # 3. Decode the latents to pixels with the VAE.
            with scope("decode"):
                video = self._decode(latents, timings)
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
        cached: dict[str, Any],
    ) -> torch.Tensor:
        """The denoised latents: vidq's loop where the model denoises as Wan 2.1 does and either the policy batches
        the guidance passes or the job has a step cache; else diffusers' own loop (``cached`` then says the step
        cache did not run, and why)."""
        own_loop = _plain_wan_loop(self.pipe)
        self._note_shape(spec, guided=negative_embeds is not None, two_passes=not self.policy.cfg_batch)

        def report(done: int, total: int) -> None:
            if on_step is not None:
                try:
                    on_step(done, total)
                except BaseException as exc:
                    from_on_step.append(exc)  # tells on_step's own errors apart from the model's
                    raise

        if own_loop and (self.policy.cfg_batch or spec.step_cache != "off"):

            def after_step(done: int, total: int) -> bool:
                report(done, total)
                return True

            return self._denoise_many([spec], prompt_embeds, negative_embeds, after_step, cached)
        if spec.step_cache != "off":
            reason = "this model denoises in diffusers' own loop"
            cached |= {"preset": "off", "asked": spec.step_cache, "reason": reason}
        return self._denoise_plain(spec, prompt_embeds, negative_embeds, report)

    def _note_shape(self, spec: GenerationSpec, *, guided: bool, members: int = 1, two_passes: bool = False) -> None:
        """Record the self-attention's kernel for this shape; log a compile for a shape the blocks have not run.
        ``two_passes``: a single video's guidance passes run one after the other (not as a batch of two)."""
        config = self.pipe.transformer.config
        tokens = tokens_per_sample(self.pipe, spec.height, spec.width, spec.num_frames)
        batch = members * (2 if guided and not (members == 1 and two_passes) else 1)
        if self.fp8_attention:
            self._attention_by_shape[tokens, batch] = self.fp8_attention
        elif self.flash4:
            self._attention_by_shape[tokens, batch] = FLASH_ATTENTION_4
        elif (tokens, batch) not in self._attention_by_shape:
            # Asked of SDPA's own dispatcher, with tensors laid out as the attention processor passes them.
            heads, head_dim = config.num_attention_heads, config.attention_head_dim
            probe = torch.empty((batch, tokens, heads, head_dim), device=self.device, dtype=self.dtype)
            probe = probe.transpose(1, 2)
            self._attention_by_shape[tokens, batch] = SDPBackend(torch._fused_sdp_choice(probe, probe, probe)).name
            del probe
        self.attention = self._attention_by_shape[tokens, batch]
        if (tokens, batch) not in self.rendered_shapes:
            if self.policy.compile_blocks:
                shape = f"{spec.height}x{spec.width}x{spec.num_frames}"
                log.info(
                    "compiling the transformer blocks for a shape not warmed up",
                    extra={"model": self.model, "shape": shape, "batch": batch},
                )
            self.rendered_shapes.add((tokens, batch))

    def _denoise_many(
        self,
        specs: list[GenerationSpec],
        prompt_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        after_step: Callable[[int, int], bool],
        cached: dict[str, Any],
    ) -> torch.Tensor:
        """WanPipeline's denoising loop for one or more videos alike but for their prompts and seeds: the same
        latents, timesteps, scheduler and guidance formula; every member's latents and both guidance passes in one
        batch (fuller GEMMs, half the launches; each sample's math unchanged), except a single video under a policy
        that keeps the passes apart (``cfg_batch`` off). ``after_step(done, total)`` False ends the loop. The specs'
        step cache (they share it: ``GenerationSpec.batch_key``) skips the transformer on the steps its preset
        skips; ``cached`` receives what it did."""
        pipe, spec = self.pipe, specs[0]
        transformer = pipe.transformer
        guided = negative_embeds is not None and spec.guidance_scale > 1.0
        split = guided and len(specs) == 1 and not self.policy.cfg_batch
        text = torch.cat([negative_embeds, prompt_embeds]) if guided and negative_embeds is not None else prompt_embeds
        text = text.to(transformer.dtype)
        pipe.scheduler.set_timesteps(spec.steps, device=self.device)
        timesteps = pipe.scheduler.timesteps
        # Drawn exactly as WanPipeline draws them, one generator per video: a seed gives the same noise as a plain
        # diffusers call of that video alone.
        draws = [
            pipe.prepare_latents(
                1,
                transformer.config.in_channels,
                spec.height,
                spec.width,
                spec.num_frames,
                torch.float32,
                self.device,
                torch.Generator(device=self.device).manual_seed(member.seed),
                None,
            )
            for member in specs
        ]
        latents = draws[0] if len(draws) == 1 else torch.cat(draws)
        del draws
        pipe.scheduler.set_begin_index(0)
        predictor = StepPredictor(preset(spec.step_cache), len(timesteps))

        def run(rows: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = transformer(
                hidden_states=rows,
                timestep=timestep.expand(rows.shape[0]),
                encoder_hidden_states=embeds,
                return_dict=False,
            )[0]
            return out

        def guided_noise(t: torch.Tensor) -> torch.Tensor:
            model_input = latents.to(transformer.dtype)
            if not guided:
                return run(model_input, t, text)
            if split:
                uncond, cond = run(model_input, t, text[:1]), run(model_input, t, text[1:])
            else:
                uncond, cond = run(torch.cat([model_input, model_input]), t, text).chunk(2)
            return uncond + spec.guidance_scale * (cond - uncond)

        moments = timesteps.tolist()  # as numbers, read once: one read per step would wait on the GPU each step
        for index, t in enumerate(timesteps):
            noise = predictor.output(index, moments[index], functools.partial(guided_noise, t))
            latents = pipe.scheduler.step(noise, t, latents, return_dict=False)[0]
            if not after_step(index + 1, len(timesteps)):
                break
        if spec.step_cache != "off":
            cached |= predictor.record()
        denoised: torch.Tensor = latents
        return denoised

    def _denoise_plain(
        self,
        spec: GenerationSpec,
        prompt_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        report: StepCallback,
    ) -> torch.Tensor:
        """diffusers' own loop (``WanPipeline.__call__``), stopped at the latents."""

        def step_end(pipe: Any, step_index: int, _timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            # The scheduler's step count, not spec.steps: a higher-order scheduler takes more.
            report(step_index + 1, pipe.num_timesteps)
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

    def _decode(self, latents: torch.Tensor, timings: dict[str, float] | None = None) -> torch.Tensor:
        """The latents' video as frames in [0, 1], (batch, frames, 3, height, width) on the device. Where the pipeline
        has a decode budget (low_vram on CUDA), the VAE decodes whole when that fits it and in tiles when not;
        ``timings["decode_tiled"]`` then says which (1.0: in tiles)."""
        vae = self.pipe.vae
        latents = latents.to(device=vae.device, dtype=torch.float32)
        # Undo the per-channel normalisation the transformer works in, exactly as WanPipeline does, in float32
        # whatever the VAE computes in.
        shape = (1, vae.config.z_dim, 1, 1, 1)
        # Kept as WanPipeline writes it (divide by 1/std) so the frames match a plain call bit for bit.
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents / inv_std + mean).to(vae.dtype)
        # cuDNN's autotuner picks among algorithms that compute the same convolution; the first decode of a shape
        # times them (a warm-up pays it), later ones reuse the choice.
        with torch.backends.cudnn.flags(enabled=True, benchmark=self.policy.conv_autotune):
            if self.decode_budget is None:
                video = vae.decode(latents, return_dict=False)[0]
            else:
                video, tiled = self._decode_within_budget(vae, latents, self.decode_budget)
                if timings is not None:
                    timings["decode_tiled"] = float(tiled)
        # "pt" keeps the frames on the device: the uint8 conversion then runs there, and only a quarter of the
        # bytes (uint8, not float32) cross to the host. In float32: a bf16 VAE's output times 255 would round to
        # bf16's 8 significant bits before the uint8 rounding.
        frames: torch.Tensor = self.pipe.video_processor.postprocess_video(video.float(), output_type="pt")
        return frames

    def _decode_within_budget(self, vae: Any, latents: torch.Tensor, budget: DecodeBudget) -> tuple[torch.Tensor, bool]:
        """Decode whole when the estimated peak of a whole decode fits ``budget``, else in tiles; a whole decode
        that runs out of memory anyway is decoded again in tiles (slower, never a failed job). Returns the video and
        whether it was decoded in tiles."""
        # The text encoder's and the streamed blocks' freed copies stay cached in many small blocks the decode's large
        # tensors cannot reuse: held beside a whole decode, they doubled the process's reserved memory on an H200.
        torch.cuda.empty_cache()
        geometry = DecoderGeometry.from_config(vae.config)
        available = budget()
        tiled = decode_tiled(latents.shape, geometry, element_bytes=vae.dtype.itemsize, budget=available)
        log.debug(
            "VAE decode",
            extra={"model": self.model, "latents": list(latents.shape), "tiled": tiled, "budget_mb": available // MIB},
        )
        if not tiled:
            vae.disable_tiling()
            try:
                video: torch.Tensor = vae.decode(latents, return_dict=False)[0]
                return video, False
            except torch.OutOfMemoryError:
                # Out of the except block before anything else: its traceback pins the failed decode's tensors.
                pass
            log.warning(
                "the VAE ran out of memory decoding whole; decoding in tiles",
                extra={"model": self.model, "latents": list(latents.shape), "budget_mb": available // MIB},
            )
            if hasattr(vae, "clear_cache"):
                vae.clear_cache()  # the decoder's feature cache still holds the failed decode's frames
            torch.cuda.empty_cache()
        vae.enable_tiling()
        video = vae.decode(latents, return_dict=False)[0]
        return video, True

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run ahead of Python: wait before reading the time
        return time.perf_counter()

    def _lap(self, since: float) -> tuple[float, float]:
        now = self._clock()
        return now - since, now


def _raise_recompile_limit() -> None:
    """torch stops compiling a function after a few shapes (and silently runs it eagerly from then on); a worker
    serves as many shapes as its jobs ask for."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its older name
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def tokens_per_sample(pipe: Any, height: int, width: int, frames: int) -> int:
    """The transformer's sequence length for one video of this shape: latent frames × latent rows × latent columns,
    each divided by its patch size."""
    p_t, p_h, p_w = pipe.transformer.config.patch_size
    latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
    scale = pipe.vae_scale_factor_spatial
    return int(latent_frames // p_t * (height // scale // p_h) * (width // scale // p_w))


def _plain_wan_loop(pipe: Any) -> bool:
    """Whether ``pipe`` denoises as Wan 2.1 does (one transformer, one timestep per sample): the batched loop
    covers that; a Wan 2.2 two-expert or per-token-timestep pipeline keeps diffusers' own loop."""
    config = getattr(pipe, "config", {})
    return (
        getattr(pipe, "transformer_2", None) is None
        and config.get("boundary_ratio") is None
        and not config.get("expand_timesteps", False)
    )


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
