"""The tokenizer of the built-in architectures: a fixed vocabulary, built in process (no download).

Both ``tiny-wan`` and ``wan2.1-1.3b-arch`` use it (docs/architecture.md, "Rendering"). The prewarmer needs the very
same one: a prompt's embedding is only reusable when both sides tokenize it alike.
"""

from __future__ import annotations

from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

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
