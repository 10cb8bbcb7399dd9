"""A small deterministic tokenizer with DeepSeek-V4's special tokens, for synthetic checkpoints.

Synthetic models need a tokenizer that behaves like the real one where it matters to a server: the same special
token strings at BOS=0/EOS=1, byte-level coverage so any UTF-8 text round-trips exactly, and files that both
`tokenizers` and `transformers.AutoTokenizer` load. Quality of the segmentation does not matter, so there are no
merges: every byte is one token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from moebox.errors import ConfigError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
# (token, special): special tokens are dropped by skip_special_tokens; think tags and DSML are kept in outputs
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS, True),
    (EOS, True),
    ("<｜User｜>", True),
    ("<｜Assistant｜>", True),
    ("<｜latest_reminder｜>", True),
    ("<think>", False),
    ("</think>", False),
    ("｜DSML｜", False),
    ("<｜action｜>", True),
    ("<｜query｜>", True),
    ("<｜authority｜>", True),
    ("<｜domain｜>", True),
    ("<｜title｜>", True),
    ("<｜read_url｜>", True),
)


def _byte_symbols() -> list[str]:
    """The 256 byte-level symbols in byte order (GPT-2's printable remapping, as `ByteLevel` uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = 0
    symbols = []
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def tokenizer_size() -> int:
    return len(SPECIAL_TOKENS) + 256


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Special tokens at ids 0..13, then the 256 byte symbols; `vocab_size` must leave room for all of them."""
    if vocab_size < tokenizer_size():
        raise ConfigError(f"vocab_size={vocab_size} is too small for the synthetic tokenizer's "
                          f"{tokenizer_size()} tokens")
    vocab = {tok: i for i, (tok, _) in enumerate(SPECIAL_TOKENS)}
    for sym in _byte_symbols():
        vocab[sym] = len(vocab)
    return register_special_tokens(byte_level(Tokenizer(models.BPE(vocab=vocab, merges=[]))))


def byte_level(tok: Tokenizer) -> Tokenizer:
    """DeepSeek-style byte-level pre-tokenizer and decoder (any UTF-8 text round-trips)."""
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def register_special_tokens(tok: Tokenizer) -> Tokenizer:
    """Mark SPECIAL_TOKENS (already in the vocab at ids 0..13) as added tokens, so text never splits them;
    the special ones are dropped by skip_special_tokens, think tags and DSML are kept."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, s in SPECIAL_TOKENS if s])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in SPECIAL_TOKENS if not s])
    return tok


def save_tokenizer(out_dir: str | Path, tok: Tokenizer) -> None:
    """Write tokenizer.json + tokenizer_config.json (loadable by `tokenizers` and `transformers.AutoTokenizer`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
