"""Deterministic training and evaluation data for the tiny DeepSeek-V4 demo model (issue G).

Why this shape
--------------
The demo model must (a) speak the real serving format, so that `moebox serve` can parse what it generates, and
(b) have something to say. So every chat document is rendered by the server's own encoder
(`moebox.server.chat_format.encode_messages`) and is exactly ``prompt + completion``:

* ``prompt`` = ``encode_messages(messages, tools=tools, thinking=thinking)``, the bytes the server feeds the
  model; it ends with the generation prompt ``<｜Assistant｜><think>`` (thinking mode) or ``<｜Assistant｜></think>``
  (chat mode).
* ``completion`` = what the model must emit after it: in thinking mode ``REASONING</think>CONTENT``, in chat mode
  ``CONTENT``; then, for a tool call, ``"\\n\\n<｜DSML｜tool_calls>…</｜DSML｜tool_calls>"``; then the EOS text. It is
  cut from ``encode_messages(messages + [target], allow_final_assistant=True)``: the encoder renders an assistant
  turn that follows the last user turn as ``reasoning + "</think>" + content + tool block + EOS`` (chat_format.md
  §2.2), which is the §4 output grammar, so a document is also byte-identical to the conversation the server will
  see when the client sends this turn back as history. The `<think>` opener belongs to the prompt, not the
  completion. `Document.completion_start` marks the split, so training can mask the loss to the completion.
* A tool call ends its document (the model stops at EOS and the client runs the tool); the answer that uses the
  tool result is a second document whose messages carry the call and a ``role: "tool"`` message.

Chat kinds: ``arith`` (add/sub/mul of small ints, step-by-step reasoning), ``count`` (letters in a word, occurrences
of a letter, reasoning that spells the word), ``multi_turn`` (2-3 user turns of follow-up arithmetic on the previous
answer; only the last assistant turn is the target, earlier ones are history), ``tool_call`` (one call to
get_weather / convert_currency / search_docs, with string, enum, number, integer and boolean arguments),
``tool_answer`` (the assistant answers from the tool result and quotes it) and ``copy`` (repeat a string of made-up
words and numbers exactly). Half of the cities, search topics and counted words are made up from syllables
(`_invented_word`): with only the few dozen real ones, a small model memorises each name instead of learning to copy
it from the prompt, and gets unseen names wrong. Each chat item picks thinking or chat mode (50/50), a system prompt
(30%), and for the non-tool kinds the tools are sometimes declared anyway (20%), so the model learns that declared
tools need not be called. Text kinds: ``code`` (line-aligned chunks of the running interpreter's standard-library
sources) and ``prose`` (their docstrings, read with `ast`, not `inspect`: importing every stdlib module has side
effects, e.g. ``antigravity`` opens a web browser). Text documents are BOS + chunk, with the whole chunk as
completion and no EOS (chunks are cut mid-file; EOS means "end of assistant turn").

Default mix (`DEFAULT_MIX`): ~67% chat, ~33% text. The chat share teaches the format and the demo's skills; the
text share gives a tiny model enough general language and code statistics to produce fluent content.

Determinism and splits
----------------------
Everything derives from SHA-256 of explicit strings (never `hash()`, never the global `random`), so the output is a
function of (split, seed, n, mix) and, for the text kinds, of the interpreter's stdlib files (sorted paths;
identical for a given Python installation). The split an item belongs to does *not* depend on the seed, so no seed
can move an item across: `split_of` hashes the item's identity and sends `HELDOUT_FRACTION` of it to "heldout". The
identity is chosen so that held-out items are really unseen: an arithmetic problem (operands sorted for + and ×;
every step of a multi-turn chain must be in the split too), a word for counting, a city for the weather tool (real
or made up), a currency pair for conversion, a topic for search, a copied string, a stdlib file for text. A text
chunk's own content hash must agree with its file's split too: then text repeated verbatim in two files (license
headers, vendored copies) can never be in both splits on any Python installation (CPython 3.11 has no such chunk at
the default size, so this costs ~20% of the text pool and buys a guarantee). Phrasing templates are shared by both
splits: evaluation measures new facts and arguments, not new wording.

`eval_records` gives structured held-out items for scoring: the expected int answer (arith, count, multi_turn), the
expected tool name and arguments (tool_call), a fact that the answer must quote (tool_answer), the string to repeat
(copy), and the held-out chunks for perplexity (code, prose). `write_corpus` writes train/heldout/eval JSONL files.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import json
import os
import random
import sys
import sysconfig
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from moebox.server.chat_format import BOS, DSML, THINK_END, THINK_START, encode_messages

__all__ = [
    "SPLITS", "KINDS", "CHAT_KINDS", "TEXT_KINDS", "DEFAULT_MIX", "HELDOUT_FRACTION", "TOOLS",
    "Document", "EvalRecord", "documents", "eval_records", "write_corpus", "split_of", "stdlib_root",
]

SPLITS = ("train", "heldout")
CHAT_KINDS = ("arith", "count", "multi_turn", "tool_call", "tool_answer", "copy")
TEXT_KINDS = ("code", "prose")
KINDS = CHAT_KINDS + TEXT_KINDS
DEFAULT_MIX: dict[str, float] = {
    "arith": 0.15, "count": 0.11, "multi_turn": 0.09, "tool_call": 0.14, "tool_answer": 0.10, "copy": 0.08,
    "code": 0.19, "prose": 0.14,
}
HELDOUT_FRACTION = 0.2
THINKING_SHARE = 0.5
SYSTEM_SHARE = 0.3
PLAIN_TOOLS_SHARE = 0.2  # non-tool chats that still declare tools
INVENTED_SHARE = 0.5     # cities, topics and words made up from syllables (see `_invented_word`)
MAX_TEXT_CHARS = 1200
MIN_TEXT_CHARS = 200
_MAX_DRAWS = 10_000

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are moebox, a small and friendly assistant.",
    "Answer the user's questions accurately.",
)

# --- tools (OpenAI request format; JSON-schema parameters) ------------------------------------------------------


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}


TOOLS: dict[str, dict] = {t["function"]["name"]: t for t in (
    _fn("get_weather", "Get the current weather in a city.", {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
    }, ["city", "unit"]),
    _fn("convert_currency", "Convert an amount of money between currencies at today's rate.", {
        "amount": {"type": "number", "description": "Amount of money to convert"},
        "from": {"type": "string", "description": "ISO 4217 code of the source currency"},
        "to": {"type": "string", "description": "ISO 4217 code of the target currency"},
    }, ["amount", "from", "to"]),
    _fn("search_docs", "Search the product documentation.", {
        "query": {"type": "string", "description": "What to search for"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 10, "description": "Maximum number of results"},
        "exact": {"type": "boolean", "description": "Only exact phrase matches"},
    }, ["query", "limit", "exact"]),
)}

# --- vocabularies -------------------------------------------------------------------------------------------------

CITIES = (
    "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Dublin", "Vienna", "Prague", "Warsaw", "Kraków",
    "Budapest", "Athens", "Oslo", "Stockholm", "Helsinki", "Copenhagen", "Reykjavík", "Zürich", "Amsterdam",
    "Brussels", "Istanbul", "Cairo", "Nairobi", "Lagos", "Cape Town", "Dubai", "Mumbai", "Delhi", "Bangkok",
    "Singapore", "Jakarta", "Manila", "Seoul", "Tokyo", "Osaka", "Beijing", "Shanghai", "Hong Kong", "Sydney",
    "Melbourne", "Auckland", "Toronto", "Vancouver", "Montreal", "New York", "Chicago", "San Francisco",
    "Los Angeles", "Seattle", "Denver", "Mexico City", "Bogotá", "Lima", "Santiago", "Buenos Aires", "São Paulo",
    "Rio de Janeiro",
)
CONDITIONS = ("sunny", "cloudy", "partly cloudy", "rainy", "snowy", "windy", "foggy", "stormy")
USD_PER_UNIT = {
    "USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067, "CHF": 1.12, "CAD": 0.73, "AUD": 0.66, "CNY": 0.14,
    "INR": 0.012, "SEK": 0.095, "NOK": 0.093, "MXN": 0.058,
}
FX_PAIRS = tuple((f, t) for f in USD_PER_UNIT for t in USD_PER_UNIT if f != t)
TOPICS = (
    "connection pooling", "rate limits", "authentication", "api keys", "streaming responses", "tool calling",
    "kv cache", "batch inference", "model loading", "quantization", "error codes", "retries", "timeouts",
    "logging", "metrics", "health checks", "configuration files", "environment variables", "docker deployment",
    "gpu memory", "context length", "sampling parameters", "stop sequences", "json mode", "embeddings",
    "tokenizer", "chat templates", "reasoning effort", "webhooks", "pagination", "caching", "load balancing",
    "tls certificates", "access control", "audit logs", "backups", "upgrades", "benchmarks", "speculative decoding",
    "expert offloading",
)
WORDS = (
    "apple", "banana", "cherry", "orange", "grape", "lemon", "mango", "peach", "pear", "plum", "melon", "berry",
    "table", "chair", "window", "door", "garden", "flower", "river", "mountain", "forest", "ocean", "island",
    "desert", "valley", "bridge", "castle", "village", "city", "street", "market", "school", "library", "museum",
    "hospital", "kitchen", "bottle", "pencil", "paper", "letter", "number", "answer", "question", "problem",
    "system", "computer", "keyboard", "monitor", "printer", "network", "server", "python", "coffee", "butter",
    "bread", "cheese", "pepper", "tomato", "potato", "carrot", "onion", "garlic", "rabbit", "turtle", "monkey",
    "giraffe", "elephant", "penguin", "dolphin", "kangaroo", "zebra", "tiger", "lion", "horse", "sheep", "goat",
    "chicken", "parrot", "spider", "butterfly", "mississippi", "balloon", "committee", "success", "bookkeeper",
    "assessment", "address", "happiness", "tomorrow", "yesterday", "morning", "evening", "summer",
    "winter", "autumn", "spring", "rainbow", "thunder", "lightning", "cloud", "snowflake", "sunshine", "planet",
    "galaxy", "rocket", "engine", "wheel", "bicycle", "airplane", "train", "subway", "harbor", "anchor", "sailor",
    "pirate", "treasure", "diamond", "silver", "golden", "purple", "yellow", "green", "violet", "crimson",
    "banner", "puzzle", "jigsaw", "pizza", "noodle", "cookie", "muffin", "pancake", "waffle", "cinnamon",
    "vanilla", "chocolate", "strawberry", "raspberry", "blueberry", "avocado", "broccoli", "cucumber", "lettuce",
    "spinach", "zucchini", "pumpkin", "squirrel", "hedgehog", "mosquito", "beetle", "ladder", "hammer", "scissors",
    "blanket", "pillow", "mirror", "candle", "guitar", "violin", "trumpet", "drum", "piano", "melody", "rhythm",
    "poetry", "novel", "chapter", "sentence", "paragraph", "alphabet", "grammar", "vowel", "syllable", "balance",
    "remember", "cocoa", "referee", "level", "radar", "kayak", "noon", "bubble", "giggle", "sleepy",
)


# --- public types ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """One training document: ``text = prompt + completion`` (see the module docstring).

    Chat documents carry what they were rendered from (`messages`, `tools`, `thinking`, and `target`, the assistant
    message the completion encodes); text documents carry their stdlib `source` path.
    """

    text: str
    kind: str
    split: str
    completion_start: int
    thinking: bool | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    target: dict | None = None
    source: str | None = None

    @property
    def prompt(self) -> str:
        return self.text[: self.completion_start]

    @property
    def completion(self) -> str:
        return self.text[self.completion_start:]

    def to_json(self) -> dict[str, Any]:
        """The JSONL row: what the tokenizer trainer and the training script need."""
        return {"text": self.text, "kind": self.kind, "split": self.split,
                "completion_start": self.completion_start, "thinking": self.thinking}


@dataclass(frozen=True)
class EvalRecord:
    """One held-out evaluation item.

    `prompt` is what the server renders for `messages`/`tools`/`thinking` (BOS for text kinds) and `completion`
    the reference output (for text kinds: the held-out chunk, scored for perplexity after BOS). What to check:
    `answer` (arith, count, multi_turn), `tool_name` + `arguments` (tool_call), `fact`, a string the answer's
    content must contain (tool_answer).
    """

    kind: str
    prompt: str
    completion: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    thinking: bool | None = None
    answer: int | None = None
    tool_name: str | None = None
    arguments: dict | None = None
    fact: str | None = None
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Item:
    """A generated item before rendering: a chat (messages + target) or a text chunk."""

    kind: str
    key: tuple  # identity, for de-duplication
    thinking: bool | None = None
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    target: dict | None = None
    chunk: str | None = None
    source: str | None = None
    expected: dict = field(default_factory=dict)  # EvalRecord fields


# --- hashing, splits, random streams ------------------------------------------------------------------------------


def _digest(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode("utf-8")).digest()[:8], "big")


def split_of(*key: object) -> str:
    """The split of an item identity (seed-independent): "heldout" for `HELDOUT_FRACTION` of identities."""
    return "heldout" if _digest("split", *key) % 10_000 < HELDOUT_FRACTION * 10_000 else "train"


def _rng(*parts: object) -> random.Random:
    return random.Random(_digest("rng", *parts))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


T = TypeVar("T")


def _draw_in_split(split: str, draw: Callable[[], T], key: Callable[[T], tuple]) -> T:
    for _ in range(_MAX_DRAWS):
        value = draw()
        if split_of(*key(value)) == split:
            return value
    raise RuntimeError(f"no {split} item found in {_MAX_DRAWS} draws")


@functools.lru_cache(maxsize=None)
def _in_split(pool: str, values: tuple[T, ...], split: str) -> tuple[T, ...]:
    return tuple(v for v in values if split_of(pool, v) == split)


# --- made-up names ----------------------------------------------------------------------------------------------------

# Made-up names: a few dozen real cities let a small model memorise every one of them instead of learning to copy
# a name from the prompt (the third and fifth sessions' demos wrote "Bogotów" for "Vienna"); millions of
# syllable strings leave copying as the only way to get them right.
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st", "tr",
           "th", "sh", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "k")
_TOPIC_NOUNS = ("settings", "errors", "sessions", "tokens", "queues", "plugins", "exports", "limits", "logs",
                "schemas")


def _invented_word(rng: random.Random) -> str:
    """2-3 random syllables, lower case (e.g. "draimonsel")."""
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(rng.choice((2, 3))))


def _entity(rng: random.Random, split: str, pool: str, real: tuple[T, ...], invent: Callable[[], T]) -> T:
    """A real entity of `pool` in `split`, or (`INVENTED_SHARE`) a made-up one in `split`; both kinds are split
    by the same identity, (pool, value)."""
    if rng.random() < INVENTED_SHARE:
        return _draw_in_split(split, invent, lambda v: (pool, v))
    return rng.choice(_in_split(pool, real, split))


# --- chat helpers ---------------------------------------------------------------------------------------------------


def _assistant(thinking: bool, reasoning: str, content: str, tool_calls: list[dict] | None = None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _tool_list(rng: random.Random, needed: str | None) -> list[dict]:
    """The request's tools: the needed one (if any) plus a random subset of the others, in random order."""
    names = [n for n in TOOLS if n != needed and rng.random() < 0.5]
    if needed is not None:
        names.append(needed)
    if not names:
        names = [rng.choice(list(TOOLS))]
    rng.shuffle(names)
    return [copy.deepcopy(TOOLS[n]) for n in names]


def _maybe_tools(rng: random.Random) -> list[dict] | None:
    return _tool_list(rng, None) if rng.random() < PLAIN_TOOLS_SHARE else None


# --- arithmetic -----------------------------------------------------------------------------------------------------

_SYM = {"add": "+", "sub": "-", "mul": "×"}
_QUESTIONS = {
    "add": ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
            "What's the sum of {a} and {b}?", "Calculate {a}+{b}", "{a} + {b} = ?"),
    "sub": ("What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}.",
            "What's {a} take away {b}?", "What is the difference between {a} and {b}?"),
    "mul": ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.",
            "What's the product of {a} and {b}?", "Compute {a} x {b}.", "What is {a} × {b}?",
            "What is {a} multiplied by {b}?"),
}
_INTROS = {
    "add": ("I need to add {a} and {b}.", "The user asks for {a} + {b}.", "Adding {a} and {b}."),
    "sub": ("I need to subtract {b} from {a}.", "The user asks for {a} - {b}.", "Subtracting {b} from {a}."),
    "mul": ("I need to multiply {a} by {b}.", "The user asks for {a} × {b}.", "Multiplying {a} by {b}."),
}
_ANSWERS = ("{a} {s} {b} = {r}.", "The answer is {r}.", "{r}", "{a} {s} {b} is {r}.")
_FOLLOW_UPS = {
    "add": ("Now add {n} to that.", "Add {n} to the result.", "What is that plus {n}?"),
    "sub": ("Now subtract {n} from that.", "Subtract {n} from the result.", "What is that minus {n}?"),
    "mul": ("Now multiply that by {n}.", "Multiply the result by {n}.", "What is that times {n}?"),
}
_FOLLOW_UP_ANSWERS = ("{p} {s} {n} = {r}.", "That gives {r}.", "The result is {r}.")


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "add" else a - b if op == "sub" else a * b


def _problem_key(op: str, a: int, b: int) -> tuple:
    return ("arith", op, *((a, b) if op == "sub" else sorted((a, b))))


def _draw_problem(rng: random.Random) -> tuple[str, int, int]:
    op = rng.choice(("add", "sub", "mul"))
    if op == "mul":
        a, b = rng.randint(2, 99), rng.randint(2, 12)
        return (op, a, b) if rng.random() < 0.5 else (op, b, a)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return (op, max(a, b), min(a, b)) if op == "sub" else (op, a, b)


def _place_parts(n: int) -> list[int]:
    """523 -> [500, 20, 3] (zero digits skipped)."""
    s = str(n)
    return [int(d) * 10 ** (len(s) - 1 - i) for i, d in enumerate(s) if d != "0"] or [0]


def _work(op: str, a: int, b: int) -> str:
    """Step-by-step working by place value."""
    s, r = _SYM[op], _apply(op, a, b)
    if op == "mul":
        big, small = (a, b) if a >= b else (b, a)
        parts = _place_parts(big)
        if len(parts) == 1:
            return f"{a} {s} {b} = {r}."
        prods = [p * small for p in parts]
        steps = " ".join(f"{p} {s} {small} = {q}." for p, q in zip(parts, prods))
        return f"Split {big} into {' + '.join(map(str, parts))}. {steps} Then {' + '.join(map(str, prods))} = {r}."
    parts = _place_parts(b)
    if len(parts) == 1:
        return f"{a} {s} {b} = {r}."
    steps, acc = [], a
    for p in parts:
        steps.append(f"{acc} {s} {p} = {_apply(op, acc, p)}.")
        acc = _apply(op, acc, p)
    return f"Split {b} into {' + '.join(map(str, parts))}. " + " ".join(steps)


def _arith_turn(rng: random.Random, thinking: bool, op: str, a: int, b: int) -> tuple[dict, dict]:
    r = _apply(op, a, b)
    question = rng.choice(_QUESTIONS[op]).format(a=a, b=b)
    reasoning = f"{rng.choice(_INTROS[op]).format(a=a, b=b)} {_work(op, a, b)} So the answer is {r}."
    content = rng.choice(_ANSWERS).format(a=a, b=b, s=_SYM[op], r=r)
    return {"role": "user", "content": question}, _assistant(thinking, reasoning, content)


def _arith(rng: random.Random, split: str, thinking: bool) -> _Item:
    op, a, b = _draw_in_split(split, lambda: _draw_problem(rng), lambda p: _problem_key(*p))
    user, target = _arith_turn(rng, thinking, op, a, b)
    return _Item("arith", _problem_key(op, a, b), thinking, [user], _maybe_tools(rng), target,
                 expected={"answer": _apply(op, a, b)})


def _follow_up(rng: random.Random, split: str, value: int) -> tuple[str, int]:
    def draw() -> tuple[str, int]:
        ops = ["add"] + (["sub"] if value >= 4 else []) + (["mul"] if value <= 500 else [])
        op = rng.choice(ops)
        n = rng.randint(2, 50) if op == "add" else rng.randint(2, min(value - 1, 50)) if op == "sub" \
            else rng.randint(2, 5)
        return op, n

    return _draw_in_split(split, draw, lambda s: _problem_key(s[0], value, s[1]))


def _multi_turn(rng: random.Random, split: str, thinking: bool) -> _Item:
    op, a, b = _draw_in_split(split, lambda: _draw_problem(rng), lambda p: _problem_key(*p))
    user, reply = _arith_turn(rng, thinking, op, a, b)
    messages, value, key = [user], _apply(op, a, b), [(op, a, b)]
    for _ in range(rng.choice((1, 2))):
        messages.append(reply)
        fop, n = _follow_up(rng, split, value)
        r = _apply(fop, value, n)
        messages.append({"role": "user", "content": rng.choice(_FOLLOW_UPS[fop]).format(n=n)})
        reasoning = f"The previous answer was {value}. {_work(fop, value, n)} So the answer is {r}."
        content = rng.choice(_FOLLOW_UP_ANSWERS).format(p=value, s=_SYM[fop], n=n, r=r)
        reply = _assistant(thinking, reasoning, content)
        value = r
        key.append((fop, n))
    return _Item("multi_turn", ("multi_turn", *key), thinking, messages, _maybe_tools(rng), reply,
                 expected={"answer": value})


# --- counting ------------------------------------------------------------------------------------------------------

_LEN_QUESTIONS = ("How many letters are in '{w}'?", "How many letters does the word '{w}' have?",
                  'Count the letters in "{w}".', "What is the length of the word '{w}'?",
                  'How long is the word "{w}" in letters?')
_LEN_ANSWERS = ("There are {n} letters in '{w}'.", "'{w}' has {n} letters.", "{n}")
_LETTER_QUESTIONS = ("How many times does '{c}' appear in '{w}'?",
                     'How many times does the letter "{c}" occur in the word "{w}"?',
                     "Count the occurrences of '{c}' in '{w}'.", "In the word '{w}', how many '{c}' letters are there?")
_LETTER_ANSWERS = ("'{c}' appears {n} {times} in '{w}'.", "The letter '{c}' occurs {n} {times}.", "{n}")


def _count(rng: random.Random, split: str, thinking: bool) -> _Item:
    word = _entity(rng, split, "word", WORDS, lambda: _invented_word(rng))
    if rng.random() < 0.4:
        n = len(word)
        question = rng.choice(_LEN_QUESTIONS).format(w=word)
        spelled = ", ".join(f"{ch} ({i})" for i, ch in enumerate(word, 1))
        reasoning = f"Spell '{word}' letter by letter and count: {spelled}. That is {n} letters."
        content = rng.choice(_LEN_ANSWERS).format(w=word, n=n)
        key: tuple = ("count", "len", word)
    else:
        absent = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word]
        letter = rng.choice(absent) if rng.random() < 0.2 else rng.choice(sorted(set(word)))
        n = word.count(letter)
        question = rng.choice(_LETTER_QUESTIONS).format(w=word, c=letter)
        seen, marks = 0, []
        for ch in word:
            seen += ch == letter
            marks.append(f"{ch} ({seen})" if ch == letter else ch)
        verdict = f"So '{letter}' appears {n} {'time' if n == 1 else 'times'}." if n else \
            f"None of them is '{letter}', so it appears 0 times."
        reasoning = f"Go through '{word}' and count each '{letter}': {', '.join(marks)}. {verdict}"
        content = rng.choice(_LETTER_ANSWERS).format(w=word, c=letter, n=n, times="time" if n == 1 else "times")
        key = ("count", "letter", word, letter)
    return _Item("count", key, thinking, [{"role": "user", "content": question}], _maybe_tools(rng),
                 _assistant(thinking, reasoning, content), expected={"answer": n})


# --- tools ---------------------------------------------------------------------------------------------------------

_WEATHER_QUESTIONS = ("What's the weather like in {city} right now? Use {unit}.",
                      "How warm is it in {city}, in {unit}?",
                      "Check the current weather in {city} for me ({unit}, please).",
                      "Is it cold in {city} today? Give me the temperature in {unit}.")
_FX_QUESTIONS = ("Convert {amount} {frm} to {to}.", "How much is {amount} {frm} in {to}?",
                 "What are {amount} {frm} worth in {to}?", "I have {amount} {frm}. How many {to} is that?")
_SEARCH_QUESTIONS = ('Search the docs for "{q}" and give me the top {limit} results, {exact}.',
                     "Find {limit} documentation pages about {q}; {exact}.",
                     "Look up {q} in the docs ({limit} results, {exact}).")
_EXACT_TEXT = {True: ("exact matches only", "exact phrase only"), False: ("loose matches are fine",
                                                                          "fuzzy matching is ok")}
_TITLES = ("{T}: overview", "Configuring {t}", "Troubleshooting {t}", "{T} reference", "How {t} works",
           "{T} FAQ", "Best practices for {t}", "Getting started with {t}", "Monitoring {t}", "{T} limits")


def _weather_call(rng: random.Random, split: str) -> tuple[str, dict, str, str]:
    """(question, arguments, reasoning, lead-in content) for a get_weather call."""
    city = _entity(rng, split, "city", CITIES, lambda: _invented_word(rng).capitalize())
    unit = rng.choice(("celsius", "fahrenheit"))
    unit_text = rng.choice((unit, unit.capitalize()))
    question = rng.choice(_WEATHER_QUESTIONS).format(city=city, unit=unit_text)
    reasoning = (f"The user wants the current weather in {city}, in {unit}. "
                 f'I should call get_weather with city "{city}" and unit "{unit}".')
    return question, {"city": city, "unit": unit}, reasoning, f"Let me check the weather in {city}."


def _fx_call(rng: random.Random, split: str) -> tuple[str, dict, str, str]:
    frm, to = rng.choice(_in_split("fx", FX_PAIRS, split))
    if rng.random() < 0.5:
        amount: int | float = rng.randint(1, 2000)
    else:
        amount = rng.randint(1, 999) + rng.randint(1, 99) / 100  # a non-zero fraction: stays a float
    shown = json.dumps(amount)
    question = rng.choice(_FX_QUESTIONS).format(amount=shown, frm=frm, to=to)
    reasoning = (f"The user wants to convert {shown} {frm} to {to}. "
                 f"I should call convert_currency with amount {shown}, from {frm} and to {to}.")
    return question, {"amount": amount, "from": frm, "to": to}, reasoning, "Let me convert that."


def _search_call(rng: random.Random, split: str) -> tuple[str, dict, str, str]:
    topic = _entity(rng, split, "topic", TOPICS,
                    lambda: f"{_invented_word(rng)} {rng.choice(_TOPIC_NOUNS)}")
    limit, exact = rng.randint(1, 10), rng.random() < 0.5
    question = rng.choice(_SEARCH_QUESTIONS).format(q=topic, limit=limit, exact=rng.choice(_EXACT_TEXT[exact]))
    reasoning = (f'The user wants up to {limit} documentation results about "{topic}", '
                 f"{'exact phrase only' if exact else 'loose matches allowed'}. "
                 f'I should call search_docs with query "{topic}", limit {limit} and exact {json.dumps(exact)}.')
    return question, {"query": topic, "limit": limit, "exact": exact}, reasoning, "Let me search the docs."


_CALLS = {"get_weather": _weather_call, "convert_currency": _fx_call, "search_docs": _search_call}


def _tool_result(rng: random.Random, name: str, args: dict) -> tuple[dict, str, str, str]:
    """(tool output, answer content, reasoning, fact the answer quotes) for a call."""
    if name == "get_weather":
        celsius = rng.randint(-15, 38)
        temp = celsius if args["unit"] == "celsius" else round(celsius * 9 / 5 + 32)
        mark = "°C" if args["unit"] == "celsius" else "°F"
        cond, humidity, city = rng.choice(CONDITIONS), rng.randint(10, 95), args["city"]
        result = {"city": city, "temperature": temp, "unit": args["unit"], "condition": cond, "humidity": humidity}
        fact = f"{temp}{mark}"
        content = rng.choice((f"It is currently {fact} and {cond} in {city}.",
                              f"The weather in {city}: {fact}, {cond}, humidity {humidity}%.",
                              f"Right now it's {cond} in {city} at {fact}."))
        reasoning = f"get_weather says {city} is at {temp} degrees {args['unit']} and {cond}. I'll report that."
    elif name == "convert_currency":
        rate = round(USD_PER_UNIT[args["from"]] / USD_PER_UNIT[args["to"]] * rng.uniform(0.98, 1.02), 4)
        converted = round(args["amount"] * rate, 2)
        result = {"amount": args["amount"], "from": args["from"], "to": args["to"], "rate": rate,
                  "result": converted}
        fact, shown = json.dumps(converted), json.dumps(args["amount"])
        content = rng.choice((f"{shown} {args['from']} is {fact} {args['to']} (rate {rate}).",
                              f"That comes to {fact} {args['to']} at a rate of {rate}."))
        reasoning = f"convert_currency returned {fact} {args['to']} at a rate of {rate}. I'll report that."
    else:
        topic = args["query"]
        n = rng.randint(1, args["limit"])
        titles = rng.sample(_TITLES, min(n, len(_TITLES)))
        hits = [{"title": t.format(t=topic, T=topic.capitalize()),
                 "url": "https://docs.example.com/" + t.format(t=topic, T=topic).lower().replace(" ", "-")
                 .replace(":", "")} for t in titles]
        result = {"query": topic, "results": hits}
        fact = hits[0]["title"]
        content = rng.choice((f'I found {len(hits)} {"page" if len(hits) == 1 else "pages"}. The best match is '
                              f'"{fact}" ({hits[0]["url"]}).',
                              f'The top result is "{fact}": {hits[0]["url"]}'))
        reasoning = f'search_docs returned {len(hits)} results; the best match is "{fact}". I\'ll share it.'
    return result, content, reasoning, fact


def _draw_call(rng: random.Random, split: str, thinking: bool) -> tuple[list[dict], list[dict], dict, str, dict]:
    """(messages, tools, assistant call message, tool name, arguments)."""
    name = rng.choice(list(_CALLS))
    question, args, reasoning, lead_in = _CALLS[name](rng, split)
    call_id = f"call_{rng.getrandbits(96):024x}"
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
    content = lead_in if rng.random() < 0.3 else ""
    return ([{"role": "user", "content": question}], _tool_list(rng, name),
            _assistant(thinking, reasoning, content, [call]), name, args)


def _call_key(name: str, args: dict) -> tuple:
    return ("tool", name, json.dumps(args, sort_keys=True, ensure_ascii=False))


def _tool_call(rng: random.Random, split: str, thinking: bool) -> _Item:
    messages, tools, call, name, args = _draw_call(rng, split, thinking)
    return _Item("tool_call", _call_key(name, args), thinking, messages, tools, call,
                 expected={"tool_name": name, "arguments": args})


def _tool_answer(rng: random.Random, split: str, thinking: bool) -> _Item:
    messages, tools, call, name, args = _draw_call(rng, split, thinking)
    result, content, reasoning, fact = _tool_result(rng, name, args)
    messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                        "content": json.dumps(result, ensure_ascii=False)}]
    return _Item("tool_answer", _call_key(name, args), thinking, messages, tools,
                 _assistant(thinking, reasoning, content), expected={"fact": fact})


# --- copying --------------------------------------------------------------------------------------------------------

_COPY_QUESTIONS = ("Repeat this exactly: {s}", "Say back exactly what follows: {s}", "Echo this text: {s}",
                   'Copy this word for word: "{s}"')


def _copy_text(rng: random.Random) -> str:
    """2-8 made-up words, some of them numbers."""
    return " ".join(str(rng.randint(0, 9999)) if rng.random() < 0.2 else _invented_word(rng)
                    for _ in range(rng.randint(2, 8)))


def _copy(rng: random.Random, split: str, thinking: bool) -> _Item:
    text = _draw_in_split(split, lambda: _copy_text(rng), lambda t: ("copy", t))
    question = rng.choice(_COPY_QUESTIONS).format(s=text)
    reasoning = f"The user wants this text repeated exactly: {text}"
    return _Item("copy", ("copy", text), thinking, [{"role": "user", "content": question}], _maybe_tools(rng),
                 _assistant(thinking, reasoning, text), expected={"fact": text})


_CHAT_MAKERS: dict[str, Callable[[random.Random, str, bool], _Item]] = {
    "arith": _arith, "count": _count, "multi_turn": _multi_turn, "tool_call": _tool_call,
    "tool_answer": _tool_answer, "copy": _copy,
}


# --- standard-library text ------------------------------------------------------------------------------------------

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
              "pydoc_data"}
_SPECIAL_MARKS = ("<\uff5c", DSML, THINK_START, THINK_END)  # special-token text must not occur in plain text


@functools.lru_cache(maxsize=1)
def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[str, ...]:
    """Relative paths of the stdlib's .py files (no tests, codec tables or build config), sorted."""
    root = stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        for f in files:
            if f.endswith(".py") and not f.startswith(("test", "_sysconfigdata")):
                out.append(Path(d, f).relative_to(root).as_posix())
    return tuple(sorted(out))




def _line_chunks(text: str, max_chars: int) -> list[str]:
    """Consecutive pieces of at most `max_chars`, cut at line ends (an over-long line is cut hard)."""
    chunks, cur = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            if cur:
                chunks.append(cur)
                cur = ""
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        if len(cur) + len(line) > max_chars:
            chunks.append(cur)
            cur = ""
        cur += line
    if cur:
        chunks.append(cur)
    return chunks


def _docstrings(source: str, module: str) -> list[str]:
    """"module.qualname\\n\\ndocstring" entries in source order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old stdlib files
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return []
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc:
            out.append(f"{prefix}\n\n{doc}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}.{child.name}")

    visit(tree, module)
    return out


@functools.lru_cache(maxsize=256)
def _file_chunks(rel: str, kind: str, max_chars: int) -> tuple[str, ...]:
    try:
        source = (stdlib_root() / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ()
    if kind == "code":
        pieces = _line_chunks(source, max_chars)
    else:
        module = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        pieces = []
        for entry in _docstrings(source, module):  # pack entries into chunks, blank line between them
            for part in _line_chunks(entry, max_chars):
                if pieces and len(pieces[-1]) + 2 + len(part) <= max_chars:
                    pieces[-1] += "\n\n" + part
                else:
                    pieces.append(part)
    return tuple(p for p in pieces if len(p) >= MIN_TEXT_CHARS and not any(m in p for m in _SPECIAL_MARKS))


@functools.lru_cache(maxsize=2048)
def _chunks_in(rel: str, kind: str, max_chars: int, split: str) -> tuple[str, ...]:
    return tuple(c for c in _file_chunks(rel, kind, max_chars) if split_of("chunk", c) == split)


def _text(kind: str, rng: random.Random, split: str, max_chars: int) -> _Item:
    files = _in_split("file", _stdlib_files(), split)
    for _ in range(_MAX_DRAWS):
        rel = rng.choice(files)
        chunks = _chunks_in(rel, kind, max_chars, split)
        if chunks:
            chunk = rng.choice(chunks)
            return _Item(kind, (kind, chunk), chunk=chunk, source=rel)
    raise RuntimeError(f"no {split} {kind} text found in the standard library at {stdlib_root()}")


# --- items -> documents / eval records ------------------------------------------------------------------------------


def _make(kind: str, rng: random.Random, split: str, max_text_chars: int) -> _Item:
    if kind in TEXT_KINDS:
        return _text(kind, rng, split, max_text_chars)
    thinking = rng.random() < THINKING_SHARE
    item = _CHAT_MAKERS[kind](rng, split, thinking)
    if rng.random() < SYSTEM_SHARE:
        item.messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return item


def _render(item: _Item) -> tuple[str, int]:
    """(full text, completion start): prompt and final assistant turn, both by the server's encoder."""
    if item.chunk is not None:
        return BOS + item.chunk, len(BOS)
    prompt = encode_messages(item.messages, tools=item.tools, thinking=item.thinking)
    full = encode_messages(item.messages + [item.target], tools=item.tools, thinking=item.thinking,
                           allow_final_assistant=True)
    if not full.startswith(prompt):
        raise RuntimeError("encode_messages: a conversation with its reply does not extend the bare prompt")
    return full, len(prompt)


def _draw_unique(make: Callable[[], _Item], seen: set[tuple], tries: int) -> _Item | None:
    for _ in range(tries):
        item = make()
        if item.key not in seen:
            seen.add(item.key)
            return item
    return None


def _allocate(n: int, mix: dict[str, float]) -> dict[str, int]:
    """Documents per kind: largest-remainder rounding of n * weight (weights need not sum to 1)."""
    unknown = set(mix) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds in mix: {sorted(unknown)}; known: {KINDS}")
    if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError("mix weights must be >= 0 with a positive sum")
    total = sum(mix.values())
    quotas = {k: n * mix.get(k, 0) / total for k in KINDS}
    counts = {k: int(q) for k, q in quotas.items()}
    for k in sorted(KINDS, key=lambda k: (counts[k] - quotas[k], KINDS.index(k)))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def documents(split: str, seed: int, n: int, mix: dict[str, float] | None = None, *,
              max_text_chars: int = MAX_TEXT_CHARS) -> list[Document]:
    """`n` documents of `split`, kinds drawn per `mix` (default `DEFAULT_MIX`), in a seeded order.

    Each kind has its own random stream, so changing the mix does not change the other kinds' items. Items are
    de-duplicated within a call where the space allows (a small pool may repeat).
    """
    _check_split(split)
    counts = _allocate(n, DEFAULT_MIX if mix is None else mix)
    docs = []
    for kind in KINDS:
        rng, seen = _rng("documents", seed, split, kind), set()
        for _ in range(counts[kind]):
            item = _draw_unique(lambda: _make(kind, rng, split, max_text_chars), seen, 20) \
                or _make(kind, rng, split, max_text_chars)
            text, start = _render(item)
            docs.append(Document(text, kind, split, start, item.thinking, item.messages or None, item.tools,
                                 item.target, item.source))
    _rng("order", seed, split).shuffle(docs)
    return docs


def eval_records(seed: int, n_per_kind: int, *, kinds: tuple[str, ...] = KINDS,
                 max_text_chars: int = MAX_TEXT_CHARS) -> list[EvalRecord]:
    """`n_per_kind` distinct held-out items of each kind (none of them ever occurs in the train split)."""
    out = []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")
        rng, seen = _rng("eval", seed, kind), set()
        for _ in range(n_per_kind):
            item = _draw_unique(lambda: _make(kind, rng, "heldout", max_text_chars), seen, 1000)
            if item is None:
                raise ValueError(f"fewer than {n_per_kind} distinct held-out {kind} items")
            text, start = _render(item)
            out.append(EvalRecord(kind, text[:start], text[start:], item.messages or None, item.tools,
                                  item.thinking, source=item.source, **item.expected))
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_corpus(out_dir: str | Path, seed: int = 0, n_train: int = 20_000, n_heldout: int = 2_000,
                 n_eval_per_kind: int = 100, mix: dict[str, float] | None = None, *,
                 max_text_chars: int = MAX_TEXT_CHARS) -> dict[str, Path]:
    """Write train.jsonl, heldout.jsonl (`Document.to_json` rows), eval.jsonl (`EvalRecord.to_json` rows) and
    manifest.json (the parameters, for reproducing the files) into `out_dir`; returns the paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.jsonl" for name in ("train", "heldout", "eval")}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        _write_jsonl(paths[split], [d.to_json() for d in documents(split, seed, n, mix,
                                                                   max_text_chars=max_text_chars)])
    _write_jsonl(paths["eval"], [r.to_json() for r in eval_records(seed, n_eval_per_kind,
                                                                   max_text_chars=max_text_chars)])
    paths["manifest"] = out / "manifest.json"
    paths["manifest"].write_text(json.dumps({
        "seed": seed, "n_train": n_train, "n_heldout": n_heldout, "n_eval_per_kind": n_eval_per_kind,
        "mix": DEFAULT_MIX if mix is None else mix, "max_text_chars": max_text_chars,
        "heldout_fraction": HELDOUT_FRACTION, "python": sys.version.split()[0], "stdlib": str(stdlib_root()),
    }, indent=2) + "\n", encoding="utf-8")
    return paths
