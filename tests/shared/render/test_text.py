"""shared/render/text.py: the rows the embedding cache stores, padded back, are bit-equal to what
``WanPipeline.encode_prompt`` gives; the identity changes with what the embeddings depend on."""

from __future__ import annotations

import torch

from shared.render.registry import TINY_WAN, build_pipeline
from shared.render.text import MAX_SEQUENCE_LENGTH, encoder_identity, pad, pipeline_text_encoder, texts_of

CPU = torch.device("cpu")
PROMPTS = ["a red fox running through fresh snow at dawn", "", "   a  boat,  on a lake !  "]


def test_padded_rows_equal_the_pipelines_own_prompt_embeddings_bit_for_bit() -> None:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    encoder = pipeline_text_encoder(pipe, encoder_identity(TINY_WAN, dtype=torch.float32))
    assert encoder is not None
    rows = encoder.encode(PROMPTS)
    for text, row in zip(PROMPTS, rows, strict=True):
        with torch.no_grad():  # as WanPipeline.__call__ runs it (with autograd on, other kernels round otherwise)
            expected, _ = pipe.encode_prompt(
                text, do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH, device=CPU
            )
        got = pad([row], max_sequence_length=MAX_SEQUENCE_LENGTH, device=CPU)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert torch.equal(got, expected), text
        assert row.shape[0] < MAX_SEQUENCE_LENGTH  # only the real tokens are kept (what the cache stores)


def test_the_identity_key_depends_on_the_text_and_the_dtype() -> None:
    f32 = encoder_identity(TINY_WAN, dtype=torch.float32)
    bf16 = encoder_identity(TINY_WAN, dtype=torch.bfloat16)
    assert f32.key("a boat") == encoder_identity(TINY_WAN, dtype=torch.float32).key("a boat")  # stable
    assert len({f32.key("a boat"), f32.key("a boat "), bf16.key("a boat")}) == 3


def test_the_negative_prompt_is_encoded_only_with_guidance() -> None:
    assert texts_of("p", "n", 5.0) == ("p", "n")
    assert texts_of("p", "", 5.0) == ("p", "")
    assert texts_of("p", "n", 1.0) == ("p",)


def test_a_packed_batch_gives_each_texts_rows_in_the_order_asked() -> None:
    pipe = build_pipeline(TINY_WAN, device=CPU, dtype=torch.float32)
    encoder = pipeline_text_encoder(pipe, encoder_identity(TINY_WAN, dtype=torch.float32))
    assert encoder is not None
    texts = [*PROMPTS, "a long prompt " * 40, "x", "a lighthouse on a cliff in a storm"]
    single = encoder.encode(texts)
    seen: list[int] = []
    forward = encoder.encoder.forward

    def spy(ids: torch.Tensor, mask: torch.Tensor, **kw: object) -> object:
        seen.append(ids.shape[1])  # the padded length of each batch
        return forward(ids, mask, **kw)

    encoder.encoder.forward = spy  # type: ignore[method-assign]
    packed = encoder.encode(texts, batch_size=3)
    for text, a, b in zip(texts, single, packed, strict=True):
        assert a.shape == b.shape, text  # the same real-token rows, in the order asked
        assert torch.allclose(a, b, atol=1e-5), text  # equal up to the kernels' rounding for another batch shape
    # Sorted by length, each batch padded to its own longest text: the short ones never pay for 512 tokens.
    assert len(seen) == 2 and seen[0] < seen[1] <= MAX_SEQUENCE_LENGTH and seen[0] < 32
