"""The worker's model registry: every diffusers pipeline a worker runs is built here.

Three kinds of model name (docs: DESIGN.md section 4, "Models without the internet"):

* ``tiny-wan``: a real ``WanPipeline`` from tiny configs with seeded random weights. It renders noise, not
  video; it exists so tests, CI and the CPU demo run the real pipeline code end to end in well under a second.
* ``wan2.1-1.3b-arch``: the Wan2.1-T2V-1.3B architecture at full size with random weights. It renders noise
  too, but its compute and memory cost are the real model's, which is what benchmarks need.
* anything else: a local diffusers folder or a hub id, loaded with ``from_pretrained`` (offline-safe for a
  folder).

Pipelines are expensive to build, so ``get_pipeline`` keeps one per model per process, built on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# From their own modules: to a type checker the package root re-exports placeholder classes.
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from shared.config import get_settings
from shared.render.pipeline import VideoPipeline

TINY_WAN = "tiny-wan"
WAN21_13B_ARCH = "wan2.1-1.3b-arch"
LOCAL = "local"  # served from settings.model_dir

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: the ids UMT5 configs use for pad and eos
MAX_TEXT_TOKENS = 512  # WanPipeline pads every prompt to 512 tokens

# A fixed vocabulary: the tokenizer (and so every embedding) is the same on every machine and in every build.
_WORDS = """
a an the and or but of in on at to from with without by for over under above below into through across near
far behind beside between around along inside outside up down left right front back top is are was be has
have it its this that there here who what where when how very slowly quickly gently suddenly together alone
still not no all some many few more one two three man woman boy girl child children baby person people
family crowd dancer cat dog bird fish horse cow lion tiger bear wolf fox rabbit deer elephant monkey dragon
butterfly tree trees flower flowers grass leaves forest garden field mountain mountains hill valley river
lake sea ocean beach waves island desert sand snow ice rain storm clouds sky sun moon stars city street road
bridge building house room kitchen window door table car bus train boat ship plane bicycle robot castle
tower village park market light shadow fire smoke water wind night day morning evening sunset sunrise spring
summer autumn winter walking running jumping flying swimming dancing playing sitting standing looking
turning falling moving spinning cooking eating drinking reading writing singing laughing smiling talking
holding opening red orange yellow green blue purple pink brown black white gray gold silver dark bright warm
cold big small tall long old young new beautiful happy sad calm quiet wild soft wet clear blurry sharp
detailed realistic cinematic dramatic colorful static smooth shaky high low quality worst best video frame
scene shot camera view close-up wide zoom slow motion style painting photo image film cartoon anime
background subtitles text overexposed ugly deformed extra fingers hands faces 0 1 2 3 4 5 6 7 8 9 . , ! ? :
; ' " - ( )
"""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A UMT5-shaped word-level tokenizer built in process: no download, identical everywhere."""
    words = list(dict.fromkeys(_WORDS.split()))  # dict keeps order and drops repeats
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation(),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    # T5 tokenizers end every sequence with </s>; the encoder was shaped around that.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_TEXT_TOKENS,
    )


def resolve_device(pref: str | None = None, *, cuda_dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """Pick the device and compute dtype: CUDA in bf16 (fp16 where bf16 is missing), else CPU in float32.

    ``pref`` is ``settings.device`` ("cuda", "cuda:1", "cpu" or None for "CUDA if there is one").
    """
    if pref is None:
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(pref)
    if device.type != "cuda":
        return device, torch.float32  # CPU half precision is slow and poorly covered by kernels
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {pref!r} was asked for but CUDA is not available")
    wanted = cuda_dtype or get_settings().cuda_dtype
    if wanted == "bfloat16" and torch.cuda.is_bf16_supported():
        return device, torch.bfloat16
    return device, torch.float16


def build_pipeline(
    model: str, *, device: torch.device, dtype: torch.dtype, model_dir: str | None = None
) -> DiffusionPipeline:
    """Build the diffusers pipeline for ``model`` on ``device``: transformer and text encoder in ``dtype``.

    The VAE stays in float32 in every case, as Wan's reference code and diffusers' Wan examples run it;
    decoding is a small share of a render's time.
    """
    if model == TINY_WAN:
        return _tiny_wan(device=device, dtype=dtype)
    if model == WAN21_13B_ARCH:
        return _wan21_13b_arch(device=device, dtype=dtype)
    if model == LOCAL and not model_dir:
        raise ValueError("model 'local' needs settings.model_dir (VIDQ_MODEL_DIR)")
    source = model_dir or model
    # A folder never touches the network; a hub id resolves from the local cache when HF_HUB_OFFLINE is set.
    pipe = DiffusionPipeline.from_pretrained(
        source,
        dtype={"default": dtype, "vae": torch.float32},
        local_files_only=Path(source).is_dir(),
    )
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)  # progress goes through on_step
    return pipe


def _tiny_wan(*, device: torch.device, dtype: torch.dtype) -> WanPipeline:
    """Tiny Wan with seeded random weights (sizes of diffusers' own Wan pipeline tests). It renders noise."""
    tokenizer = build_tokenizer()
    # Built on the CPU in fp32 with a seed before each module, so the weights are the same on every machine.
    with _materialise_on(torch.device("cpu"), torch.float32):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        torch.manual_seed(0)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=32,  # must equal the transformer's text_dim
                d_kv=8,
                d_ff=37,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                dropout_rate=0.0,
            )
        )
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return _assemble(tokenizer, text_encoder, transformer, vae, scheduler, device=device, dtype=dtype)


def _wan21_13b_arch(*, device: torch.device, dtype: torch.dtype) -> WanPipeline:
    """Wan2.1-T2V-1.3B at full size with random weights: the real model's cost, noise for output."""
    # Materialise straight on the target device in the target dtype: the 5.7B-parameter UMT5-XXL encoder would
    # need 23 GB of host RAM in fp32 first, and a host-to-device copy of it costs more than the GPU init does.
    with _materialise_on(device, dtype):
        torch.manual_seed(0)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=256384,
                d_model=4096,
                d_kv=64,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu",
                dropout_rate=0.0,
            )
        )
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        )
    with _materialise_on(device, torch.float32):
        torch.manual_seed(0)
        vae = AutoencoderKLWan()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return _assemble(build_tokenizer(), text_encoder, transformer, vae, scheduler, device=device, dtype=dtype)


def _assemble(
    tokenizer: PreTrainedTokenizerFast,
    text_encoder: UMT5EncoderModel,
    transformer: WanTransformer3DModel,
    vae: AutoencoderKLWan,
    scheduler: SchedulerMixin,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> WanPipeline:
    # The precision from_pretrained(dtype=...) would give a real checkpoint: dtype, except the modules each
    # library lists as fp32-only. The VAE is left in the fp32 it was built in (see build_pipeline).
    _cast(transformer, dtype, keep_fp32=WanTransformer3DModel._keep_in_fp32_modules or ())
    _cast(text_encoder, dtype, keep_fp32=_text_encoder_fp32_modules(text_encoder, dtype))
    pipe = WanPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]  # annotated AutoTokenizer, takes any tokenizer
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,  # type: ignore[arg-type]  # annotated FlowMatchEuler, takes any scheduler
        transformer=transformer,
    )
    pipe.to(device)
    for module in (text_encoder, transformer, vae):
        module.eval()  # modules built by hand start in training mode (dropout on); from_pretrained ones don't
    pipe.set_progress_bar_config(disable=True)  # progress goes through on_step
    return pipe


@contextmanager
def _materialise_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors go to ``device``, with ``dtype`` as the default float type until the block ends."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def _text_encoder_fp32_modules(model: UMT5EncoderModel, dtype: torch.dtype) -> Collection[str]:
    # transformers keeps T5's "wo" in fp32 only for fp16, where its activations overflow; bf16 has the range.
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return keep


def _cast(module: torch.nn.Module, dtype: torch.dtype, *, keep_fp32: Collection[str]) -> None:
    """Cast floating tensors to ``dtype`` as ``from_pretrained`` does: names in ``keep_fp32`` go to fp32.

    A tensor's name matches a listed module when one of its dotted parts equals it (``blocks.0.norm2.weight``
    matches ``norm2``).
    """
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point():
            target = torch.float32 if set(name.split(".")) & set(keep_fp32) else dtype
            if tensor.dtype != target:
                tensor.data = tensor.data.to(target)


_cache: dict[str, VideoPipeline] = {}
_cache_lock = threading.Lock()


def get_pipeline(model: str) -> VideoPipeline:
    """The process-wide pipeline for ``model``, built on first use and then kept warm on the device."""
    with _cache_lock:  # one build per model even when two threads ask at once
        if model not in _cache:
            settings = get_settings()
            device, dtype = resolve_device(settings.device, cuda_dtype=settings.cuda_dtype)
            model_dir = settings.model_dir if model == LOCAL else None
            pipe = build_pipeline(model, device=device, dtype=dtype, model_dir=model_dir)
            _cache[model] = VideoPipeline(pipe, model=model, device=device, dtype=dtype)
        return _cache[model]


def clear_cache() -> None:
    """Drop every cached pipeline (tests; a worker that must free its GPU)."""
    with _cache_lock:
        _cache.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
