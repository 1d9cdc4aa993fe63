"""No cold start: compiled kernels persist across worker restarts, and a worker renders its warm-up shapes before it
reports ready.

torch.compile keeps what it builds in an on-disk cache (``TORCHINDUCTOR_CACHE_DIR``: generated kernels, compiled
graphs, autotuning results). ``use_compile_cache`` points it at the worker's cache directory and loads the portable
archive of a previous process (``torch.compiler.save_cache_artifacts``), which also carries the graphs torch's
per-process caches would otherwise rebuild; ``save_compile_cache`` writes that archive after a warm-up. FlashAttention
4's kernels, compiled on first use as well, are kept in a folder of their own beside them. A restarted worker on the
same machine then loads its kernels instead of compiling them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from shared.render.pipeline import VideoPipeline
from shared.spec import GenerationSpec, parse_shape

log = logging.getLogger("vidq.render.warmup")

WARMUP_STEPS = 2  # the scheduler's first step differs from the rest; the kernels are the same from the second on


def _archive(cache_dir: Path) -> Path:
    # One archive per torch build and device: kernels compiled for one GPU model do not run on another.
    device = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    return cache_dir / f"artifacts-torch{torch.__version__}-{device}.bin"


def use_compile_cache(cache_dir: str) -> Path | None:
    """Point torch.compile's on-disk caches at ``cache_dir`` (created) and load the archive a previous worker saved
    there. Call before the first compile. A directory that cannot be made is logged, and torch keeps its own
    default (the worker still renders; a restart compiles again): None."""
    path = Path(cache_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("compile cache directory unusable; kernels will not persist", extra={"error": repr(exc)})
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    # FlashAttention 4 compiles its kernels on first use too (shared/render/attention.py); read when it is imported.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(path / "flash_attention_4"))
    archive = _archive(path)
    if archive.exists():
        try:
            torch.compiler.load_cache_artifacts(archive.read_bytes())
            log.info("compile cache loaded", extra={"path": str(archive), "bytes": archive.stat().st_size})
        except Exception as exc:  # an archive from another build: compile afresh and overwrite it after warm-up
            log.warning("compile cache unreadable; compiling afresh", extra={"path": str(archive), "error": repr(exc)})
    return path


def save_compile_cache(cache_dir: str) -> None:
    """Write what this process has compiled (and loaded) as the archive the next worker loads."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    data, _info = saved
    archive = _archive(Path(cache_dir).expanduser())
    partial = archive.with_suffix(f".{os.getpid()}.tmp")
    try:
        partial.write_bytes(data)
        partial.replace(archive)  # atomic: a worker starting meanwhile reads the old archive or the new, never half
    except OSError as exc:  # a full or read-only disk costs the next start a compile, never this worker its jobs
        log.warning("compile cache not saved", extra={"path": str(archive), "error": repr(exc)})
        partial.unlink(missing_ok=True)
        return
    log.info("compile cache saved", extra={"path": str(archive), "bytes": len(data)})


def warm_up(pipeline: VideoPipeline, shapes: list[str], *, guidance_scale: float = 5.0) -> dict[str, float]:
    """Render each shape once (a few steps, with classifier-free guidance, from zero text embeddings: no text
    encoder is needed) so its kernels are compiled or loaded before the first job. Returns seconds per shape."""
    width_of_text = pipeline.pipe.transformer.config.text_dim
    seconds: dict[str, float] = {}
    for shape in shapes:
        height, width, frames = parse_shape(shape)
        spec = GenerationSpec(
            model=pipeline.model,
            prompt="warm-up",
            negative_prompt="warm-up",
            width=width,
            height=height,
            num_frames=frames,
            fps=16,
            steps=WARMUP_STEPS,
            guidance_scale=guidance_scale,
            seed=0,
        )

        def rows(texts: list[str]) -> list[torch.Tensor]:
            return [torch.zeros((1, width_of_text), dtype=pipeline.dtype) for _ in texts]

        started = time.perf_counter()
        pipeline.generate(spec, text_rows=rows)
        seconds[shape] = round(time.perf_counter() - started, 3)
        log.info("warmed up", extra={"model": pipeline.model, "shape": shape, "seconds": seconds[shape]})
    return seconds
