"""`moebox eval`: what the demo model can do on held-out items, with native experts and with w2 planes.

Each chat record is generated greedily from the exact prompt the server would send, and its completion is read
back with the server's own parser, so a score says what an API client would get:
  arith, count, multi_turn   accuracy: the last integer of the answer's content equals the expected one
  tool_call                  validity: one call of a declared tool whose arguments are JSON that fits its schema;
                             correctness: the expected tool with exactly the expected arguments
  tool_answer                the answer's content quotes the fact from the tool result
  copy                       the answer's content is exactly the text the user asked to be repeated; and, since a
                             small model gets part of it right long before all of it, the mean similarity of the
                             two (difflib's ratio: 1 for equal texts, 0 for nothing in common)
  code, prose                perplexity of the held-out chunk after BOS
Comparing w2 with native experts also gives top-1 agreement and KL(native, w2) of the next-token
distributions over the held-out text, the direct measure of what the 2-bit planes cost. With `mtp_k`, the chat
items are generated again with k MTP drafts verified every step (no adaptive policy), giving the mean accepted
length (tokens per verify step, the bonus token included) and the acceptance rate of the drafts.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moebox.server.parsers import parse_completion
from moebox.train.data import CHAT_KINDS, KINDS, TEXT_KINDS, EvalRecord, eval_records

_INT = re.compile(r"-?\d[\d,]*")


def fits_schema(value: Any, schema: dict) -> bool:
    """The JSON-schema subset tool parameters use here: object/required/properties, string/number/integer/
    boolean, enum."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and all(k in props and fits_schema(v, props[k]) for k, v in value.items()))
    checks = {"string": lambda v: isinstance(v, str),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool)}
    return checks[kind](value) if kind in checks else True


@dataclass
class Score:
    correct: bool
    valid: bool = True          # tool_call: a well-formed call of a declared tool


def score(record: EvalRecord, completion: str) -> Score:
    """Score one generated completion of a chat record (as the server would parse it)."""
    _, content, calls, _ = parse_completion(completion, bool(record.thinking), record.tools)
    content = content or ""
    if record.kind == "tool_call":
        tools = {t["function"]["name"]: t["function"] for t in record.tools or []}
        if len(calls) != 1 or calls[0]["function"]["name"] not in tools:
            return Score(False, False)
        try:
            args = json.loads(calls[0]["function"]["arguments"])
        except json.JSONDecodeError:
            return Score(False, False)
        name = calls[0]["function"]["name"]
        valid = fits_schema(args, tools[name].get("parameters", {}))
        return Score(valid and name == record.tool_name and args == record.arguments, valid)
    if record.kind == "tool_answer":
        return Score(not calls and record.fact is not None and record.fact in content)
    if record.kind == "copy":
        return Score(not calls and content.strip() == record.fact)
    numbers = _INT.findall(content)
    return Score(not calls and bool(numbers) and int(numbers[-1].replace(",", "")) == record.answer)


def copy_similarity(record: EvalRecord, completion: str) -> float:
    """How close a copy record's answer comes to the requested text (difflib ratio in [0, 1])."""
    _, content, _, _ = parse_completion(completion, bool(record.thinking), record.tools)
    return difflib.SequenceMatcher(None, (content or "").strip(), record.fact or "").ratio()


@dataclass
class Report:
    experts: str
    rows: dict[str, float] = field(default_factory=dict)


def _token_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False).ids


def chat_prompts(tokenizer, records: list[EvalRecord], max_len: int | None = None) -> list[list[int]]:
    """The token ids of the chat records' prompts (the text already holds BOS and the chat markup), each cut to
    `max_len` tokens if given."""
    return [tokenizer.encode(r.prompt, add_special_tokens=False).ids[:max_len]
            for r in records if r.kind in CHAT_KINDS]


def text_logits(llm, records: list[EvalRecord]) -> list[tuple[torch.Tensor, list[int]]]:
    """Per held-out chunk: next-token logits over the chunk's tokens and those tokens (after the prompt)."""
    out = []
    for rec in tqdm(records, desc="held-out text", unit="chunk", leave=False):
        prompt, ids = _token_ids(llm, rec.prompt), _token_ids(llm, rec.completion)
        full = (prompt + ids)[:llm.max_model_len]
        logits = llm.logits(full)[len(prompt) - 1:-1].float().cpu()
        out.append((logits, full[len(prompt):]))
    return out


def evaluate(llm, records: list[EvalRecord], experts: str, max_tokens: int = 192
             ) -> tuple[Report, list[tuple[torch.Tensor, list[int]]]]:
    from moebox import SamplingParams
    report = Report(experts)
    chat = [r for r in records if r.kind in CHAT_KINDS]
    outs = llm.generate(chat_prompts(llm.tokenizer, chat, llm.max_model_len - max_tokens),
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, skip_special_tokens=False),
                        use_tqdm=True, desc=f"{experts}: chat items")
    scores = [(r, score(r, o.outputs[0].text)) for r, o in zip(chat, outs)]
    for kind in CHAT_KINDS:
        got = [s for r, s in scores if r.kind == kind]
        if got:
            name = {"tool_call": "tool_call correct"}.get(kind, f"{kind} accuracy")
            report.rows[name] = sum(s.correct for s in got) / len(got)
            if kind == "tool_call":
                report.rows["tool_call valid"] = sum(s.valid for s in got) / len(got)
            if kind == "copy":
                report.rows["copy similarity"] = sum(copy_similarity(r, o.outputs[0].text) for r, o in
                                                     zip(chat, outs) if r.kind == kind) / len(got)
    text_records = [r for r in records if r.kind in TEXT_KINDS]
    text = text_logits(llm, text_records)
    for kind in TEXT_KINDS:
        pairs = [pair for pair, r in zip(text, text_records) if r.kind == kind]
        if pairs:
            nll = sum(torch.nn.functional.cross_entropy(lg, torch.tensor(ids), reduction="sum").item()
                      for lg, ids in pairs)
            report.rows[f"{kind} perplexity"] = math.exp(nll / sum(len(ids) for _, ids in pairs))
    return report, text


def agreement(native: list[tuple[torch.Tensor, list[int]]], w2: list[tuple[torch.Tensor, list[int]]]
              ) -> dict[str, float]:
    """Top-1 agreement and mean KL(native, w2) over all held-out text positions."""
    a = torch.cat([lg for lg, _ in native])
    b = torch.cat([lg for lg, _ in w2])
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    return {"top-1 agreement w2 vs native": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "KL native to w2 per token": kl.item()}


def mtp_acceptance(model: str | Path, records: list[EvalRecord], k: int, experts: str, device: str,
                   store_dir: str | Path | None, max_tokens: int) -> dict[str, float]:
    """Greedy generation of the chat records with k drafts verified every step: acceptance metrics."""
    from moebox import LLM, SamplingParams
    llm = LLM(model, device=device, experts=experts, store_dir=store_dir, max_num_seqs=16, progress=False,
              speculative_config={"num_speculative_tokens": k, "adaptive": False})
    llm.generate(chat_prompts(llm.tokenizer, records, llm.max_model_len - max_tokens),
                 SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=True,
                 desc=f"{experts}: MTP k={k}")
    steps, drafted, accepted = llm.engine.metrics.spec_counts()
    return {f"MTP k={k} mean accepted length": 1 + accepted / max(steps, 1),
            f"MTP k={k} draft acceptance": accepted / max(drafted, 1)}


def run_eval(model: str | Path, experts: list[str], n_per_kind: int, seed: int = 0, device: str = "cpu",
             store_dir: str | Path | None = None, kinds: tuple[str, ...] = KINDS, max_tokens: int = 192,
             mtp_k: tuple[int, ...] = ()) -> str:
    """The markdown table of `evaluate` for each expert format (and their agreement when both ran)."""
    from moebox import LLM
    records = eval_records(seed, n_per_kind, kinds=kinds)
    reports, texts = [], {}
    for fmt in experts:
        llm = LLM(model, device=device, experts=fmt, store_dir=store_dir, max_num_seqs=16, progress=False)
        report, texts[fmt] = evaluate(llm, records, fmt, max_tokens)
        del llm
        for k in mtp_k:
            report.rows.update(mtp_acceptance(model, records, k, fmt, device, store_dir, max_tokens))
        reports.append(report)
    names = list(dict.fromkeys(k for r in reports for k in r.rows))
    lines = ["| metric | " + " | ".join(r.experts for r in reports) + " |", "|---" * (len(reports) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{r.rows[n]:.3f}" if n in r.rows else "" for r in reports) + " |"
              for n in names]
    if "native" in texts and "w2" in texts and texts["native"]:
        lines += [f"| {k} | {v:.4f} |" + " |" * (len(reports) - 1) for k, v in
                  agreement(texts["native"], texts["w2"]).items()]
    return "\n".join(lines)
