"""Training/eval data generator (moebox.train.data): determinism, disjoint splits, and that every chat document is
exactly "served prompt + what the server parses back".

Expected values are computed here independently: arithmetic and counting answers from the question text, DSML
blocks and special tokens typed from ../shared/docs/chat_format.md, tool arguments checked against their JSON
schema by a small checker below.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moebox.server.chat_format import encode_messages
from moebox.server.parsers import parse_completion
from moebox.train import data
from moebox.train.data import KINDS, Document, documents, eval_records, write_corpus

EOS = "<｜end▁of▁sentence｜>"
BOS = "<｜begin▁of▁sentence｜>"
D = "｜DSML｜"
CHAT = ("arith", "count", "multi_turn", "tool_call", "tool_answer", "copy")


@pytest.fixture(scope="module")
def train() -> list[Document]:
    return documents("train", 0, 1000)


@pytest.fixture(scope="module")
def heldout() -> list[Document]:
    return documents("heldout", 0, 300)


@pytest.fixture(scope="module")
def records():
    return eval_records(0, 20)


def _chat(docs):
    return [d for d in docs if d.kind in CHAT]


# --- independent truth --------------------------------------------------------------------------------------------

_OP_WORDS = (("sub", ("subtract", "minus", "take away", "difference", " - ")),
             ("mul", ("times", "multipl", "product", " x ", "×", "*")),
             ("add", ("plus", "add", "sum", "+")))


def _op(text: str) -> str:
    low = text.lower()
    ops = [op for op, words in _OP_WORDS if any(w in low for w in words)]
    assert len(ops) == 1, text
    return ops[0]


def _calc(op: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b}[op]


def _question_problem(q: str) -> tuple[str, int, int]:
    """(op, a, b) of a first-turn arithmetic question, read from its text."""
    nums = [int(x) for x in re.findall(r"\d+", q)]
    assert len(nums) == 2, q
    op = _op(q)
    if op == "sub" and "subtract" in q.lower():  # "Subtract B from A"
        nums.reverse()
    return op, nums[0], nums[1]


def _chain(user_texts: list[str]) -> list[tuple[str, int, int, int]]:
    """Every step (op, a, b, result) of a conversation of arithmetic questions and follow-ups on "that"."""
    op, a, b = _question_problem(user_texts[0])
    steps = [(op, a, b, _calc(op, a, b))]
    for text in user_texts[1:]:
        (n,) = [int(x) for x in re.findall(r"\d+", text)]
        op, prev = _op(text), steps[-1][3]
        steps.append((op, prev, n, _calc(op, prev, n)))
    return steps


def _count_truth(q: str) -> tuple[str, int]:
    quoted = re.findall(r"['\"]([a-z]+)['\"]", q)
    if len(quoted) == 1:
        return quoted[0], len(quoted[0])
    (letter,) = [x for x in quoted if len(x) == 1]
    (word,) = [x for x in quoted if len(x) > 1]
    return word, word.count(letter)


def _copy_request(q: str) -> str:
    """The text a copy question asks to be repeated: all after the first ": ", without quotes."""
    return q.split(": ", 1)[1].strip('"')


def _last_int(text: str) -> int:
    return int(re.findall(r"-?\d+", text)[-1])


def _users(messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def _check_schema(schema: dict, value) -> None:
    """The JSON-schema subset the tools use: object/properties/required, string/enum, integer, number, boolean,
    minimum/maximum. Unknown properties are rejected."""
    t = schema["type"]
    if t == "object":
        assert isinstance(value, dict)
        assert set(schema.get("required", [])) <= set(value) and set(value) <= set(schema["properties"]), value
        for k, v in value.items():
            _check_schema(schema["properties"][k], v)
        return
    ok = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}[t]
    assert ok(value), (schema, value)
    if "enum" in schema:
        assert value in schema["enum"]
    assert schema.get("minimum", value) <= value <= schema.get("maximum", value)


def _same_typed(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_typed(a[k], b[k]) for k in a)
    return a == b


def _dsml(tool_calls: list[dict]) -> str:
    """The tool block as typed from the spec (§2.2/§4): raw strings, JSON for everything else."""
    invokes = []
    for tc in tool_calls:
        params = []
        for k, v in json.loads(tc["function"]["arguments"]).items():
            s = isinstance(v, str)
            params.append(f'<{D}parameter name="{k}" string="{"true" if s else "false"}">'
                          f'{v if s else json.dumps(v)}</{D}parameter>')
        invokes.append(f'<{D}invoke name="{tc["function"]["name"]}">\n' + "\n".join(params) + f"\n</{D}invoke>")
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def _schemas(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


# --- determinism --------------------------------------------------------------------------------------------------


def test_same_seed_same_output_other_seed_differs():
    a = documents("train", 7, 60)
    assert a == documents("train", 7, 60)
    assert [d.text for d in a] != [d.text for d in documents("train", 8, 60)]
    assert {d.text for d in a}.isdisjoint(d.text for d in documents("heldout", 7, 60))
    assert eval_records(7, 2) == eval_records(7, 2) != eval_records(8, 2)


def test_deterministic_across_processes():
    """No hash() or other per-process state: another interpreter with another hash seed writes the same rows."""
    code = ("import json, sys; from moebox.train.data import documents, eval_records; "
            "json.dump([d.to_json() for d in documents('train', 3, 40)] "
            "+ [r.to_json() for r in eval_records(3, 1)], sys.stdout)")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    here = [d.to_json() for d in documents("train", 3, 40)] + [r.to_json() for r in eval_records(3, 1)]
    assert json.loads(out) == json.loads(json.dumps(here))


def test_mix_counts_and_arguments():
    assert {d.kind for d in documents("train", 0, 10, {"arith": 1})} == {"arith"}
    kinds = [d.kind for d in documents("train", 0, 7, {"count": 1, "code": 1})]
    assert sorted(kinds) == ["code"] * 3 + ["count"] * 4  # 3.5 each: the tie goes to the earlier kind
    docs = documents("train", 0, 100)
    assert len(docs) == 100 and {d.kind for d in docs} == set(KINDS)
    for kw in ({"mix": {"poetry": 1}}, {"mix": {"arith": -1, "count": 2}}, {"mix": {"arith": 0}}):
        with pytest.raises(ValueError):
            documents("train", 0, 5, **kw)
    with pytest.raises(ValueError):
        documents("validation", 0, 5)


# --- splits -------------------------------------------------------------------------------------------------------


def _identities(docs_or_records) -> dict[str, set]:
    """What must never be shared between the splits, read from the items (not from the generator's keys)."""
    out: dict[str, set] = {k: set() for k in ("problem", "question", "word", "call", "city", "fx", "topic",
                                              "copied", "chunk", "source")}
    for x in docs_or_records:
        msgs = x.messages or []
        users = _users(msgs)
        if x.kind in ("arith", "multi_turn"):
            for op, a, b, _ in _chain(users):
                out["problem"].add((op, *((a, b) if op == "sub" else sorted((a, b)))))
            out["question"].add(tuple(users))
        elif x.kind == "count":
            out["word"].add(_count_truth(users[0])[0])
            out["question"].add(tuple(users))
        elif x.kind == "copy":
            out["copied"].add(_copy_request(users[0]))
        elif x.kind in ("tool_call", "tool_answer"):
            out["question"].add(users[0])
            calls = [tc for m in msgs + [getattr(x, "target", None) or {}] for tc in (m.get("tool_calls") or [])]
            if isinstance(x, data.EvalRecord) and x.kind == "tool_call":
                calls.append({"function": {"name": x.tool_name, "arguments": json.dumps(x.arguments)}})
            for tc in calls:
                name, args = tc["function"]["name"], json.loads(tc["function"]["arguments"])
                out["call"].add((name, json.dumps(args, sort_keys=True)))
                if name == "get_weather":
                    out["city"].add(args["city"])
                elif name == "convert_currency":
                    out["fx"].add((args["from"], args["to"]))
                else:
                    out["topic"].add(args["query"])
        else:
            out["chunk"].add(x.completion)
            out["source"].add(x.source)
    return out


def test_train_and_heldout_share_no_eval_item(train, heldout, records):
    tr = _identities(train)
    for name, other in (("heldout docs", _identities(heldout)), ("eval records", _identities(records))):
        for what, values in other.items():
            assert values, (name, what)  # every identity kind is exercised
            assert not values & tr[what], (name, what, sorted(values & tr[what])[:5])


def test_eval_records(records):
    by_kind = {k: [r for r in records if r.kind == k] for k in KINDS}
    assert all(len(v) == 20 for v in by_kind.values())
    for r in records:
        if r.kind in CHAT:
            assert r.prompt == encode_messages(r.messages, tools=r.tools, thinking=r.thinking)
            assert r.completion.endswith(EOS)
        else:
            assert r.prompt == BOS and len(r.completion) >= 200 and r.source
    for k in ("arith", "count", "multi_turn"):
        assert all(type(r.answer) is int for r in by_kind[k])
        assert len({tuple(_users(r.messages)) for r in by_kind[k]}) == 20  # distinct items
    assert len({(r.tool_name, json.dumps(r.arguments, sort_keys=True)) for r in by_kind["tool_call"]}) == 20
    assert len({r.completion for r in by_kind["code"]}) == 20


# --- serving format -----------------------------------------------------------------------------------------------


def test_documents_are_served_prompt_plus_completion(train, heldout):
    chat = _chat(train + heldout)
    for doc in chat:
        t = doc.target
        assert doc.prompt == encode_messages(doc.messages, tools=doc.tools, thinking=doc.thinking)
        assert doc.text == encode_messages(doc.messages + [t], tools=doc.tools, thinking=doc.thinking,
                                           allow_final_assistant=True)
        assert doc.prompt.startswith(BOS)
        assert doc.prompt.endswith("<｜Assistant｜><think>" if doc.thinking else "<｜Assistant｜></think>")
        want = (t["reasoning_content"] + "</think>" if doc.thinking else "") + t["content"] \
            + (_dsml(t["tool_calls"]) if t.get("tool_calls") else "") + EOS
        assert doc.completion == want
        assert doc.completion.count(EOS) == 1 and "<think>" not in doc.completion
    assert {(d.kind, d.thinking) for d in chat} == {(k, m) for k in CHAT for m in (True, False)}
    assert any(d.tools for d in chat if d.kind == "arith") and any(d.messages[0]["role"] == "system" for d in chat)


def test_tools_survive_the_servers_request_model():
    """The server re-dumps request tools through pydantic (field order name, description, parameters) before
    rendering; the training tools must come out byte-identical, or served prompts would differ from training."""
    from moebox.server.protocol import ToolDef

    for tool in data.TOOLS.values():
        assert json.dumps(ToolDef(**tool).model_dump(exclude_unset=True)) == json.dumps(tool)


def test_tool_call_turn_reappears_verbatim_in_the_answer_document(heldout):
    """The tool-call completion, rendered back as history, is byte-identical to what the model emitted."""
    for doc in (d for d in heldout if d.kind == "tool_answer"):
        user_end = next(i for i, m in enumerate(doc.messages) if m["role"] == "assistant")
        call = doc.messages[user_end]
        first = encode_messages(doc.messages[:user_end], tools=doc.tools, thinking=doc.thinking)
        emitted = (call["reasoning_content"] + "</think>" if doc.thinking else "") + call["content"] \
            + _dsml(call["tool_calls"]) + EOS
        assert doc.prompt.startswith(first + emitted + "<｜User｜><tool_result>")


def test_completions_parse_back(train, heldout):
    for doc in _chat(train + heldout):
        reasoning, content, calls, finish = parse_completion(doc.completion, doc.thinking, doc.tools)
        t = doc.target
        assert reasoning == (t["reasoning_content"] if doc.thinking else None)
        assert content == (t["content"] or None)
        assert len(calls) == len(t.get("tool_calls", []))
        assert finish == ("tool_calls" if calls else "stop")


def test_tool_calls_parse_to_expected_typed_arguments(train, heldout, records):
    seen_types = set()
    for doc in (d for d in train + heldout if d.kind == "tool_call"):
        (want,) = doc.target["tool_calls"]
        _, _, (got,), _ = parse_completion(doc.completion, doc.thinking, doc.tools)
        name, args = got["function"]["name"], json.loads(got["function"]["arguments"])
        expected = json.loads(want["function"]["arguments"])
        assert name == want["function"]["name"] and _same_typed(args, expected), (args, expected)
        _check_schema(_schemas(doc.tools)[name], args)
        seen_types |= {(name, k, type(v).__name__, v if isinstance(v, bool) else None) for k, v in args.items()}
    # the non-string cases are really exercised: int and float amounts, both booleans, integer limits
    assert {("convert_currency", "amount", "int", None), ("convert_currency", "amount", "float", None),
            ("search_docs", "exact", "bool", True), ("search_docs", "exact", "bool", False),
            ("search_docs", "limit", "int", None), ("get_weather", "unit", "str", None)} <= seen_types
    for r in (r for r in records if r.kind == "tool_call"):
        _, _, (got,), _ = parse_completion(r.completion, r.thinking, r.tools)
        assert got["function"]["name"] == r.tool_name
        assert _same_typed(json.loads(got["function"]["arguments"]), r.arguments)
        _check_schema(_schemas(r.tools)[r.tool_name], r.arguments)


# --- answers are true ---------------------------------------------------------------------------------------------


def _content(x) -> str:
    return parse_completion(x.completion, x.thinking, x.tools)[1]


def test_arithmetic_and_counting_answers_are_true(train, heldout, records):
    items = [x for x in train + heldout + records if x.kind in ("arith", "multi_turn", "count")]
    assert len(items) > 300
    for x in items:
        users = _users(x.messages)
        if x.kind == "count":
            truth = _count_truth(users[0])[1]
        else:
            steps = _chain(users)
            truth = steps[-1][3]
            history = [m["content"] for m in x.messages if m["role"] == "assistant"]
            assert [_last_int(c) for c in history] == [s[3] for s in steps[:-1]]  # earlier replies were right too
        assert _last_int(_content(x)) == truth, (users, _content(x))
        if isinstance(x, data.EvalRecord):
            assert x.answer == truth


def test_tool_answers_quote_the_tool_result(heldout, records):
    items = [x for x in heldout + records if x.kind == "tool_answer"]
    for x in items:
        tool_msg = x.messages[-1]
        assert tool_msg["role"] == "tool"
        result = json.loads(tool_msg["content"])
        call = json.loads(x.messages[-2]["tool_calls"][0]["function"]["arguments"])
        if "temperature" in result:
            assert result["city"] == call["city"] and result["unit"] == call["unit"]
            fact = f"{result['temperature']}{'°C' if result['unit'] == 'celsius' else '°F'}"
        elif "rate" in result:
            assert result["result"] == round(call["amount"] * result["rate"], 2)
            fact = json.dumps(result["result"])
        else:
            assert 1 <= len(result["results"]) <= call["limit"]
            fact = result["results"][0]["title"]
        assert fact in _content(x)
        if isinstance(x, data.EvalRecord):
            assert x.fact == fact


def test_copy_answers_repeat_the_request(heldout, records):
    items = [x for x in heldout + records if x.kind == "copy"]
    assert items
    for x in items:
        request = _copy_request(_users(x.messages)[0])
        assert _content(x) == request and len(request.split()) >= 2
        if isinstance(x, data.EvalRecord):
            assert x.fact == request


def test_most_names_to_copy_are_made_up(train):
    """Copying, not memorising, is the way to get a name right: the train split holds far more distinct cities,
    topics and words than the real-name pools (each name in a test reached only through the items' text)."""
    ids = _identities(train)
    for what, real in (("city", data.CITIES), ("topic", data.TOPICS), ("word", data.WORDS)):
        assert len(ids[what] - set(real)) > len(ids[what] & set(real)) / 2, what
        assert len(ids[what]) > (len(real) if what != "word" else 100), what


# --- text ---------------------------------------------------------------------------------------------------------


def test_text_documents_come_from_the_stdlib(train):
    text = [d for d in train if d.kind in ("code", "prose")]
    assert {d.kind for d in text} == {"code", "prose"}
    root = data.stdlib_root()
    for d in text:
        assert d.prompt == BOS and d.completion_start == len(BOS)
        chunk = d.completion
        assert 200 <= len(chunk) <= data.MAX_TEXT_CHARS
        assert "<｜" not in chunk and "<think>" not in chunk and D not in chunk
        if d.kind == "code":
            assert chunk in (root / d.source).read_text(encoding="utf-8")
    assert len({d.completion for d in text}) == len(text)  # no repeated chunk within a call


def test_write_corpus(tmp_path):
    paths = write_corpus(tmp_path / "corpus", seed=5, n_train=30, n_heldout=10, n_eval_per_kind=1)
    rows = {k: [json.loads(line) for line in paths[k].read_text(encoding="utf-8").splitlines()]
            for k in ("train", "heldout", "eval")}
    assert rows["train"] == [d.to_json() for d in documents("train", 5, 30)]
    assert rows["heldout"] == [d.to_json() for d in documents("heldout", 5, 10)]
    assert [r["kind"] for r in rows["eval"]] == list(KINDS)
    for row in rows["train"]:
        assert row["text"][row["completion_start"]:] and row["split"] == "train"
    assert json.loads(paths["manifest"].read_text())["seed"] == 5
