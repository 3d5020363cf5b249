"""Character-level tokenizer for the demo tasks, built as a real Hugging Face tokenizer.

One token per character keeps the tiny demo model honest: an answer of N characters is N decode
steps, so a KV budget bites on the scratchpad tasks, and no merge table hides arithmetic structure.
The result is a `tokenizers` WordLevel model behind a per-character split, saved as
tokenizer.json + tokenizer_config.json, so `transformers.AutoTokenizer.from_pretrained(dir)` (and
any engine that reads HF tokenizer files) loads it without sparsecast installed.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:  # imported where a tokenizer is built: the vocab alone is wanted without transformers
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order

# Every character the built-in tasks and their prompts use, plus enough printable ASCII that a
# GSM8K-style question degrades to <unk> only on exotic characters. Order is part of the vocab:
# never reorder, only append (the warm-start recipe hash covers the vocab).
CHARACTERS = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n"
    + "+-*/=()[],.:;#?!'\"$%&<>_|@^~{}\\`"
)


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The demo tokenizer: one id per character, BOS prepended on encode, EOS/PAD as special tokens."""
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    # Split every character (newlines included) into its own word; WordLevel then maps it to an id.
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()  # join characters back without inserting spaces
    bos_id = raw.token_to_id(BOS)
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    tok = build_tokenizer()
    tok.save_pretrained(str(out_dir))
    return tok
