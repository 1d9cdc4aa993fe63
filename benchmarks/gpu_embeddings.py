"""Encoder-free GPU workers, measured on the GPU: VRAM with and without the text encoder, and the encode stage of a
render (claim to first denoising step) for a cold prompt (UMT5 on the GPU) vs a cached one.

For ``wan2.1-1.3b-arch`` (UMT5-XXL + the 1.3B transformer, random weights) at one shape:

* resident VRAM after the build and peak VRAM of a render, with the encoder (``VIDQ_WORKER_TEXT_ENCODER=local``)
  and without it (``remote``), measured in the same run; the ratio is remote / local;
* the ``encode_text`` stage and the time from ``generate()`` to the end of the first denoising step, per prompt,
  cold (the pipeline's own encoder, one text at a time as the worker does) vs cached (the rows unpacked from the
  bytes an L2/L3 hit returns, checked, padded and copied to the GPU); p50/p95 over ``--prompts`` distinct prompts.
  The Redis round trip of an L2 hit is not part of this figure (no Redis on the GPU machine): benchmarks/
  cache_replay.py measures the cache path against a real Redis;
* bytes per cached prompt (safetensors, and zstd as L3 stores it when zstandard is importable);
* optionally (``--cpu-encoder``) UMT5-XXL in bf16 on the CPU: what a CPU prewarmer costs per prompt.

    python -m benchmarks.gpu_embeddings --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shared.render.architectures import WAN21_13B_ARCH, build_wan21_text_encoder
from shared.render.pipeline import VideoPipeline
from shared.render.registry import build_pipeline
from shared.render.text import TextEncoder, encoder_identity, texts_of
from shared.spec import GenerationSpec
from shared.textcache.codec import pack, unpack

GIB = 1024**3
NEGATIVE = "blurry, low quality, static, overexposed, worst quality, deformed, extra fingers"
SUBJECTS = ["a red fox", "a lighthouse", "a small boat", "two children", "a white horse", "an old man", "a dragon"]
PLACES = ["in fresh snow", "on a cliff in a storm", "on a calm lake", "in a busy market", "across a wide field"]
STYLES = ["at dawn, cinematic", "at night, dramatic light", "in the rain, realistic", "anime style", "wide shot"]


def prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        s, p, st = SUBJECTS[i % len(SUBJECTS)], PLACES[(i // 3) % len(PLACES)], STYLES[(i // 5) % len(STYLES)]
        out.append(f"{s} {p} {st}, shot {i}" + ", slow camera" * (i % 4))
    return out


def spec(prompt: str, args: argparse.Namespace, steps: int) -> GenerationSpec:
    return GenerationSpec(
        model=args.model,
        prompt=prompt,
        negative_prompt=NEGATIVE,
        width=args.width,
        height=args.height,
        num_frames=args.frames,
        fps=16,
        steps=steps,
        guidance_scale=5.0,
        seed=0,
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_s": round(pct(values, 0.5), 4),
        "p95_s": round(pct(values, 0.95), 4),
        "mean_s": round(statistics.fmean(values), 4),
    }


def timed_render(vp: VideoPipeline, s: GenerationSpec, text_rows: Any = None) -> tuple[float, float]:
    """(encode_text stage, generate() to the end of the first denoising step) in seconds."""
    first: list[float] = []
    started = time.perf_counter()

    def on_step(done: int, total: int) -> None:
        if not first:
            if CUDA:
                torch.cuda.synchronize()
            first.append(time.perf_counter() - started)

    result = vp.generate(s, on_step=on_step, text_rows=text_rows)
    return result.timings_s["encode_text"], first[0]


CUDA = torch.cuda.is_available()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def build(model: str, text_encoder: bool) -> tuple[VideoPipeline, float]:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    before = allocated()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if CUDA else (torch.device("cpu"), torch.float32)
    pipe = build_pipeline(model, device=device, dtype=dtype, text_encoder=text_encoder)
    vp = VideoPipeline(pipe, model=model, device=device, dtype=dtype)
    if CUDA:
        torch.cuda.synchronize()
    return vp, (allocated() - before) / GIB


def peak_of_render(vp: VideoPipeline, s: GenerationSpec, text_rows: Any = None) -> float:
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    vp.generate(s, text_rows=text_rows)
    return torch.cuda.max_memory_allocated() / GIB if CUDA else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument(
        "--steps", type=int, default=2, help="steps of the peak-VRAM render (peak does not grow with steps)"
    )
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--cpu-encoder", action="store_true", help="time UMT5-XXL bf16 on the CPU (only that)")
    parser.add_argument("--model", default=WAN21_13B_ARCH, help="tiny-wan: a CPU smoke test of this script")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if not CUDA and args.model == WAN21_13B_ARCH:
        print("this benchmark needs a CUDA device (tiny-wan runs on the CPU as a smoke test)", file=sys.stderr)
        return 2

    texts = prompts(args.prompts)
    if args.cpu_encoder:
        return cpu_encoder(texts, args)
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.gpu_embeddings", *(argv or sys.argv[1:])])
    }

    # --- with the text encoder (local) ---------------------------------------------------------------------------
    local, resident_local = build(args.model, text_encoder=True)
    warm = spec("warm-up prompt", args, steps=1)
    local.generate(warm)  # kernels, allocator and cuDNN plans warmed once
    peak_local = peak_of_render(local, spec(texts[0], args, args.steps))
    cold_encode, cold_first = [], []
    stored: dict[str, bytes] = {}
    identity = local.identity
    for text in texts:
        encode_s, first_s = timed_render(local, spec(text, args, steps=1))
        cold_encode.append(encode_s)
        cold_first.append(first_s)
        for t in texts_of(text, NEGATIVE, 5.0):
            key = identity.key(t)
            stored.setdefault(key, pack(key, local.encode_texts([t])[0]))
    del local
    gc.collect()
    torch.cuda.empty_cache()

    # --- without it (remote): embeddings come from the cache ------------------------------------------------------
    remote, resident_remote = build(args.model, text_encoder=False)

    def from_cache(batch: list[str]) -> list[torch.Tensor]:
        return [unpack(stored[identity.key(t)], key=identity.key(t), identity=identity) for t in batch]

    zeros = torch.zeros(4, identity.hidden_size, dtype=remote.dtype)
    remote.generate(warm, text_rows=lambda b: [zeros for _ in b])
    peak_remote = peak_of_render(remote, spec(texts[0], args, args.steps), text_rows=from_cache)
    cached_encode, cached_first = [], []
    for text in texts:
        encode_s, first_s = timed_render(remote, spec(text, args, steps=1), text_rows=from_cache)
        cached_encode.append(encode_s)
        cached_first.append(first_s)
    del remote
    gc.collect()
    torch.cuda.empty_cache()

    sizes = [len(v) for v in stored.values()]
    report["bytes_per_text"] = {
        "safetensors_mean": round(statistics.fmean(sizes)),
        "max": max(sizes),
        "texts": len(sizes),
    }
    try:
        import zstandard

        packed = [len(zstandard.ZstdCompressor(level=3).compress(v)) for v in stored.values()]
        report["bytes_per_text"]["zstd3_mean"] = round(statistics.fmean(packed))
    except ImportError:
        pass
    report["shape"] = {
        "height": args.height,
        "width": args.width,
        "frames": args.frames,
        "steps_peak_render": args.steps,
    }
    report["vram_gib"] = {
        "resident_local": round(resident_local, 2),
        "resident_remote": round(resident_remote, 2),
        "peak_local": round(peak_local, 2),
        "peak_remote": round(peak_remote, 2),
        "peak_ratio_remote_over_local": round(peak_remote / peak_local, 3) if peak_local else None,
        "text_encoder_resident": round(resident_local - resident_remote, 2),
    }
    report["encode_stage"] = {"cold_local_encoder": summary(cold_encode), "cached": summary(cached_encode)}
    report["to_first_step_end"] = {"cold_local_encoder": summary(cold_first), "cached": summary(cached_first)}
    report["ratio_cached_over_cold_p95_encode"] = round(pct(cached_encode, 0.95) / pct(cold_encode, 0.95), 4)

    import diffusers
    import transformers

    report["machine"] = {
        "gpu": torch.cuda.get_device_name(0) if CUDA else "none (CPU smoke test)",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 1) if CUDA else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_embeddings_{args.model}_{dt.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(report, indent=2))
    path.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report, indent=2))
    return 0


def markdown(report: dict[str, Any], cpu: dict[str, Any] | None = None) -> str:
    """The short summary for people (benchmarks/README.md: JSON for machines, Markdown for people)."""
    v, e, f, b, m = (report[k] for k in ("vram_gib", "encode_stage", "to_first_step_end", "bytes_per_text", "machine"))
    shape = report["shape"]
    lines = [
        "# Encoder-free workers: VRAM and the encode stage, with and without the text encoder",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {m['gpu']} ({m['gpu_memory_gib']} GiB), torch {m['torch']} (CUDA {m['cuda']}), diffusers "
        f"{m['diffusers']}, transformers {m['transformers']}, Python {m['python']}; {m['date']}",
        f"- model: wan2.1-1.3b-arch (UMT5-XXL + the 1.3B transformer, random weights), bf16, VAE fp32; "
        f"{shape['height']}×{shape['width']}×{shape['frames']}, CFG 5",
        "",
        "| | with the text encoder (local) | without it (remote) | remote / local |",
        "|---|---|---|---|",
        f"| resident VRAM after the build | {v['resident_local']} GiB | {v['resident_remote']} GiB | "
        f"{v['resident_remote'] / v['resident_local']:.3f} |",
        f"| peak VRAM of a render ({shape['steps_peak_render']} steps) | {v['peak_local']} GiB | {v['peak_remote']} "
        f"GiB | {v['peak_ratio_remote_over_local']} |",
        "",
        "| per render, p50 / p95 / mean s | cold: the pipeline's own encoder | cached: rows unpacked, checked, padded "
        "| cached / cold (p95) |",
        "|---|---|---|---|",
        f"| `encode_text` stage | {e['cold_local_encoder']['p50_s']} / {e['cold_local_encoder']['p95_s']} / "
        f"{e['cold_local_encoder']['mean_s']} | {e['cached']['p50_s']} / {e['cached']['p95_s']} / "
        f"{e['cached']['mean_s']} | {report['ratio_cached_over_cold_p95_encode']} |",
        f"| `generate()` to the end of the first denoising step | {f['cold_local_encoder']['p50_s']} / "
        f"{f['cold_local_encoder']['p95_s']} / {f['cold_local_encoder']['mean_s']} | {f['cached']['p50_s']} / "
        f"{f['cached']['p95_s']} / {f['cached']['mean_s']} | |",
        "",
        f"- bytes per cached text (prompt or negative prompt, {b['texts']} texts): {b['safetensors_mean']} B as "
        f"safetensors (L2), {b.get('zstd3_mean', '–')} B zstd level 3 (L3); the largest {b['max']} B",
        f"- the text encoder's resident share: {v['text_encoder_resident']} GiB",
        "- the Redis round trip of an L2 hit is not in the cached figure (no Redis on the GPU machine); "
        "benchmarks/results/cache_replay_*.md measures the cache path against a real Redis",
        "- the cold figure is UMT5-XXL on the GPU the worker renders on; with an encoder-free worker a cold prompt is "
        "encoded by the prewarmer instead (below for a CPU prewarmer)",
    ]
    if cpu is not None:
        c = cpu["cpu_bf16_umt5xxl"]
        lines += [
            f"- UMT5-XXL in bf16 on the same machine's CPU ({c['threads']} threads): "
            f"{', '.join(str(t) for t in c['per_text_s'])} s per text (random init took {c['build_s']} s; a real "
            "checkpoint loads from disk instead)",
        ]
    return "\n".join(lines) + "\n"


def cpu_encoder(texts: list[str], args: argparse.Namespace) -> int:
    """UMT5-XXL in bf16 on the CPU, as a CPU prewarmer serving bf16 GPU workers runs it."""
    from shared.render.tokenizer import build_tokenizer

    started = time.perf_counter()
    cpu = TextEncoder(
        build_tokenizer(),
        build_wan21_text_encoder(device=torch.device("cpu"), dtype=torch.bfloat16),
        identity=encoder_identity(WAN21_13B_ARCH, dtype=torch.bfloat16),
    )
    build_s = time.perf_counter() - started
    print(f"cpu build {build_s:.1f} s, {torch.get_num_threads()} threads", flush=True)
    times = []
    for text in texts[:3]:
        t0 = time.perf_counter()
        cpu.encode([text])
        times.append(time.perf_counter() - t0)
        print(f"cpu encode {times[-1]:.2f} s", flush=True)
    report = {
        "cpu_bf16_umt5xxl": {
            "build_s": round(build_s, 1),
            "per_text_s": [round(t, 2) for t in times],
            "threads": torch.get_num_threads(),
        }
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_embeddings_cpu_encoder_{dt.date.today():%Y%m%d}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
