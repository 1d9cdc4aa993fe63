"""The Wan VAE's decoder, compiled: its norms, activations, causal pads, cache copies and residual adds fused into a
few kernels around cuDNN's convolutions.

The VAE decodes a video one latent frame at a time, carrying a cache of the previous frames' features from one
frame to the next; the first frames' caches differ in length, so a frame size compiles a handful of graphs, the same
set for every video length. Two details keep it that way:

* the decoder is handed each latent frame as its own contiguous tensor (the VAE passes a slice of the whole video,
  whose strides depend on the video's length, and compiled graphs are specialised on strides);
* the temporal upsamplers mark "no frame yet" in the cache with a string, and compare cached tensors against that
  string; torch before 2.13 cannot trace a tensor compared with a string, and broke the decoder into dozens of
  pieces recompiled per module and frame. ``_upsample3d_forward`` is diffusers' own upsampler step with the marker
  told apart by its type instead: the same computation, one graph.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T, WanResample
from torch._dynamo.exc import TorchDynamoException

log = logging.getLogger("vidq.render")

FIRST_FRAME = "Rep"  # the upsampler's own cache marker: its first frame was not upsampled in time


def compile_decoder(vae: Any) -> None:
    """Compile ``vae``'s decoder in place (static shapes, one whole graph per call). Where torch cannot trace it
    whole (another torch or diffusers), the decoder is logged once and decodes eagerly: slower, never wrong."""
    decoder = vae.decoder
    for module in decoder.modules():
        if isinstance(module, WanResample) and module.mode == "upsample3d":
            module.forward = types.MethodType(_upsample3d_forward, module)  # type: ignore[method-assign]
    eager = decoder.forward
    compiled: Any = torch.compile(eager, fullgraph=True, dynamic=False)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal compiled
        if compiled is not None:
            try:
                out: torch.Tensor = compiled(x.contiguous(), *args, **kwargs)
                return out
            except TorchDynamoException as exc:  # raised before the graph runs: the frame's cache is untouched
                log.warning("the VAE decoder cannot be compiled here; it decodes eagerly", extra={"error": repr(exc)})
                compiled = None
        result: torch.Tensor = eager(x, *args, **kwargs)
        return result

    decoder.forward = forward


def _upsample3d_forward(
    self: WanResample, x: torch.Tensor, feat_cache: list[Any] | None = None, feat_idx: list[int] | None = None
) -> torch.Tensor:
    """``WanResample.forward`` in its "upsample3d" mode (diffusers 0.42), the cache marker tested by type."""
    b, c, t, h, w = x.size()
    if feat_cache is not None:
        index = feat_idx if feat_idx is not None else [0]
        idx = index[0]
        cached = feat_cache[idx]
        if cached is None:
            feat_cache[idx] = FIRST_FRAME
        else:
            first = isinstance(cached, str)
            cache_x = x[:, :, -CACHE_T:, :, :].clone()
            if cache_x.shape[2] < 2:
                # The last frame of the previous chunk (zeros before the first one) ahead of this chunk's.
                previous = torch.zeros_like(cache_x) if first else cached[:, :, -1:, :, :].to(cache_x.device)
                cache_x = torch.cat([previous, cache_x], dim=2)
            x = self.time_conv(x) if first else self.time_conv(x, cached)
            feat_cache[idx] = cache_x
            x = x.reshape(b, 2, c, t, h, w)
            x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
            x = x.reshape(b, c, t * 2, h, w)
        index[0] += 1
    t = x.shape[2]
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = self.resample(x)
    out: torch.Tensor = x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)
    return out
