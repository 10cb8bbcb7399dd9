"""A byte-level BPE tokenizer trained on the training corpus, with DeepSeek-V4's special tokens.

The shipped small model needs a real segmentation (one token per byte makes sequences 3-4x longer, and a tiny
model's context and speed suffer), while the server only relies on what `moebox.weights.tokenizer` fixes: the
special token strings at ids 0..13 (BOS 0, EOS 1), byte-level coverage so any UTF-8 text round-trips, and files that
`tokenizers` and `transformers` load. So: the same pre-tokenizer (with digits split one by one first), decoder and
special tokens, plus merges learned from the corpus. Special token strings are cut out of the training text first,
so no merge is spent on their pieces; they always encode as single ids.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from moebox.errors import ConfigError
from moebox.weights.tokenizer import SPECIAL_TOKENS, byte_level, register_special_tokens

_SPECIAL = re.compile("|".join(re.escape(t) for t, _ in SPECIAL_TOKENS))
MIN_VOCAB = len(SPECIAL_TOKENS) + 256


def _without_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        yield from (piece for piece in _SPECIAL.split(text) if piece)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """BPE merges learned from `texts` up to `vocab_size` ids (special tokens and the 256 bytes included);
    deterministic for the same texts in the same order."""
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"vocab_size={vocab_size}: a byte-level tokenizer with the V4 special tokens needs at "
                          f"least {MIN_VOCAB}")
    tok = byte_level(Tokenizer(models.BPE()))
    # one token per digit: a small model can learn the digit sums of place-value arithmetic, not the sums of
    # the hundreds of multi-digit tokens BPE would merge (the first demos' arithmetic was 0-5% right)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[t for t, _ in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_without_special_tokens(texts), trainer)
    return register_special_tokens(tok)
