"""DeepSeek-V4 output parser: whole-text parse, and the same text streamed split at every character boundary
(plus one-character and random multi-splits) must give the same reasoning / content / tool calls.

(The engine's detokenizer only hands out whole characters, so character boundaries are the byte boundaries the
parser can see.)
"""

from __future__ import annotations

import json
import random
import re

import pytest

from moebox.server.parsers import Delta, OutputParser, assemble, parse_completion

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
ID_RE = re.compile(r"^call_[0-9a-f]{24}$")


def block(*invokes):
    return f"<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def invoke(name, *params):
    return f'<{D}invoke name="{name}">\n' + "".join(p + "\n" for p in params) + f"</{D}invoke>"


def param(name, value, string=True):
    return f'<{D}parameter name="{name}" string="{"true" if string else "false"}">{value}</{D}parameter>'


def fn(name, **props):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    fn("get_weather", location={"type": "string"}, days={"type": "integer"}, unit={"type": "string"}),
    fn("edit", path={"type": "string"}, old={"type": "string"}, new={"type": "string"}, replace_all={"type": "boolean"},
       lines={"type": "array", "items": {"type": "integer"}}, opts={"type": "object"}, ratio={"type": "number"}),
    fn("bash", command={"type": "string"}, timeout={"type": ["integer", "null"]}),
    fn("noargs"),
    fn("code", code={"type": "string"}, id={"anyOf": [{"type": "integer"}, {"type": "string"}]}),
]

TRICKY = 'if a < b and c > d: print("x</y>") \'q\' \\n\n  tab\there </think> <think> ｜ 北京 😀'

# (name, text, thinking, parser kwargs, finish reason given, expected (reasoning, content, [(name, args)], finish))
CASES = [
    ("readme", "Simple arithmetic.</think>2 + 2 = 4." + EOS, True, {}, "stop",
     ("Simple arithmetic.", "2 + 2 = 4.", [], "stop")),
    ("reasoning_content", "Let me think.\nStep 1.\n\n</think>\n\nThe answer is 4.\n", True, {}, "stop",
     ("Let me think.\nStep 1.\n\n", "\n\nThe answer is 4.\n", [], "stop")),
    ("content_lt_endings", "</think>a <b> c <", True, {}, "stop", (None, "a <b> c <", [], "stop")),
    ("one_call_types",
     "Need weather.</think>Let me check.\n\n" + block(invoke(
         "get_weather", param("location", "Beijing"), param("days", "5", False), param("unit", "celsius"))),
     True, {"tools": TOOLS}, "stop",
     ("Need weather.", "Let me check.", [("get_weather", {"location": "Beijing", "days": 5, "unit": "celsius"})],
      "tool_calls")),
    ("object_array_bool_number",
     "r</think>\n\n" + block(invoke(
         "edit", param("path", "src/a.py"), param("lines", "[1, 2, 3]", False), param("opts", '{"k": {"n": [1, "x"]}}', False),
         param("replace_all", "true", False), param("ratio", "0.5", False))),
     True, {"tools": TOOLS}, "stop",
     ("r", None, [("edit", {"path": "src/a.py", "lines": [1, 2, 3], "opts": {"k": {"n": [1, "x"]}}, "replace_all": True,
                            "ratio": 0.5})], "tool_calls")),
    ("several_invokes",
     "Two things.</think>" + "\n\n" + block(
         invoke("bash", param("command", "ls -la")),
         invoke("get_weather", param("location", "Paris")),
         invoke("noargs")),
     True, {"tools": TOOLS}, "stop",
     ("Two things.", None, [("bash", {"command": "ls -la"}), ("get_weather", {"location": "Paris"}), ("noargs", {})],
      "tool_calls")),
    ("tricky_values_unicode",
     "思考中……😀</think>好的。\n\n" + block(invoke(
         "edit", param("path", "文件.py"), param("old", TRICKY), param("new", ""), param("opts", '{"s": "<\\"q\\">"}', False))),
     True, {"tools": TOOLS}, "stop",
     ("思考中……😀", "好的。", [("edit", {"path": "文件.py", "old": TRICKY, "new": "", "opts": {"s": '<"q">'}})],
      "tool_calls")),
    ("truncated_call_at_max_tokens",
     "r</think>Sure.\n\n" + block(invoke("bash", param("command", "echo 1")),
                                  invoke("edit", param("path", "x.py")))[:-60],
     True, {"tools": TOOLS}, "length",
     ("r", "Sure.", [("bash", {"command": "echo 1"})], "length")),
    ("truncated_in_first_call",
     "r</think>Sure.\n\n" + f'<{D}tool_calls>\n<{D}invoke name="bash">\n<{D}parameter name="command" string="true">rm -',
     True, {"tools": TOOLS}, "length", ("r", "Sure.", [], "length")),
    ("truncated_in_block_start", "r</think>Sure.\n\n<｜DSML｜tool_ca", True, {"tools": TOOLS}, "length",
     ("r", "Sure.", [], "length")),
    ("truncated_in_reasoning", "I am still thi", True, {"tools": TOOLS}, "length", ("I am still thi", None, [], "length")),
    ("dsml_inside_reasoning",
     "I should call the tool.\n\n" + block(invoke("get_weather", param("location", "Oslo"))),
     True, {"tools": TOOLS}, "stop",
     ("I should call the tool.", None, [("get_weather", {"location": "Oslo"})], "tool_calls")),
    ("chat_mode", "Hello!\n\nHere:\n\n" + block(invoke("bash", param("command", "pwd"))), False, {"tools": TOOLS}, "stop",
     (None, "Hello!\n\nHere:", [("bash", {"command": "pwd"})], "tool_calls")),
    ("chat_mode_stray_think_tags", "</think>Hi <think>there</think>!", False, {}, "stop", (None, "Hi there!", [], "stop")),
    ("coercion",
     "</think>" + block(
         invoke("get_weather", param("location", "5", False), param("days", '"7"', False)),
         invoke("bash", param("command", "true", False), param("timeout", "30")),
         invoke("code", param("code", "x = 1"), param("id", "12", False)),
         invoke("edit", param("replace_all", "False", False), param("lines", "[3]")),
     ),
     True, {"tools": TOOLS}, "stop",
     (None, None, [("get_weather", {"location": "5", "days": 7}), ("bash", {"command": "true", "timeout": 30}),
                   ("code", {"code": "x = 1", "id": 12}), ("edit", {"replace_all": False, "lines": [3]})], "tool_calls")),
    ("unwrap_arguments",
     "</think>" + block(invoke("get_weather", param("arguments", '{"location": "Rome", "days": "3"}', False)),
                        invoke("bash", param("input", '{"command": "ls"}'))),
     True, {"tools": TOOLS}, "stop",
     (None, None, [("get_weather", {"location": "Rome", "days": 3}), ("bash", {"command": "ls"})], "tool_calls")),
    ("unknown_tool_kept", "</think>" + block(invoke("mystery", param("a", "1", False), param("b", "x"))), True,
     {"tools": TOOLS}, "stop", (None, None, [("mystery", {"a": 1, "b": "x"})], "tool_calls")),
    ("tool_choice_none_keeps_text",
     "</think>Text.\n\n" + block(invoke("bash", param("command", "ls"))), True, {"tools": TOOLS, "tool_choice": "none"},
     "stop", (None, "Text.\n\n" + block(invoke("bash", param("command", "ls"))), [], "stop")),
    ("parallel_false_keeps_first",
     "</think>" + block(invoke("bash", param("command", "a")), invoke("bash", param("command", "b"))), True,
     {"tools": TOOLS, "parallel_tool_calls": False}, "stop", (None, None, [("bash", {"command": "a"})], "tool_calls")),
    ("length_right_after_block", "</think>" + block(invoke("noargs")), True, {"tools": TOOLS}, "length",
     (None, None, [("noargs", {})], "tool_calls")),
    ("eos_passed_in", "x</think>done" + EOS + "garbage", True, {}, "stop", ("x", "done", [], "stop")),
    ("newlines_without_tools", "</think>a\n\nb\n\n", True, {"tools": TOOLS}, "stop", (None, "a\n\nb\n\n", [], "stop")),
    ("empty", "", True, {}, "stop", (None, None, [], "stop")),
]


def _norm(reasoning, content, calls):
    return reasoning, content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _check_calls(calls):
    for c in calls:
        assert ID_RE.match(c["id"]) and c["type"] == "function"
        json.loads(c["function"]["arguments"])  # valid JSON
    assert len({c["id"] for c in calls}) == len(calls)


def _stream(text, thinking, kw, reason, pieces):
    p = OutputParser(thinking, kw.get("tools"), tool_choice=kw.get("tool_choice", "auto"),
                     parallel_tool_calls=kw.get("parallel_tool_calls", True))
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += p.feed(piece)
    tail, finish = p.finish(reason)
    deltas += tail
    return deltas, finish


def _check_deltas(deltas, tool_choice_none=False):
    seen: dict[int, str] = {}
    for d in deltas:
        if d.kind == "content" and not tool_choice_none:
            assert "</think>" not in d.text and "<think>" not in d.text and D not in d.text
        if d.kind == "tool_call":
            if d.id is not None:
                assert d.index not in seen and ID_RE.match(d.id) and d.name and d.arguments == ""
                seen[d.index] = d.id
            else:
                assert d.index in seen and d.name is None
    assert sorted(seen) == list(range(len(seen)))


def _splits(text):
    n = len(text)
    yield [text]
    for k in range(n + 1):
        yield [text[:k], text[k:]]
    yield list(text)
    rng = random.Random(n)
    for _ in range(10):
        cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [n])]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parse_whole_and_streamed(case):
    _, text, thinking, kw, reason, expected = case
    reasoning, content, calls, finish = parse_completion(text, thinking, finish_reason=reason, **kw)
    _check_calls(calls)
    assert (*_norm(reasoning, content, calls), finish) == expected
    none_mode = kw.get("tool_choice") == "none"
    if not none_mode and content is not None:
        assert "</think>" not in content and "<think>" not in content and D not in content
    for pieces in _splits(text):
        deltas, s_finish = _stream(text, thinking, kw, reason, pieces)
        _check_deltas(deltas, none_mode)
        s_reasoning, s_content, s_calls = assemble(deltas)
        _check_calls(s_calls)
        assert (*_norm(s_reasoning, s_content, s_calls), s_finish) == expected, pieces


def test_header_streams_before_arguments_and_separator_is_held():
    p = OutputParser(True, TOOLS)
    assert p.feed("ok</think>Checking.\n") == [Delta("reasoning", "ok"), Delta("content", "Checking.")]
    assert p.feed("\n") == []  # still possibly the separator before a tool block
    assert p.feed("<｜DSML｜tool_") == []
    out = p.feed('calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">l')
    assert len(out) == 1 and out[0].kind == "tool_call" and out[0].name == "bash" and out[0].index == 0
    assert p.feed("s</｜DSML｜parameter>\n") == []
    out = p.feed("</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    assert out == [Delta("tool_call", index=0, arguments='{"command": "ls"}')]
    assert p.finish("stop") == ([], "tool_calls")


def test_reasoning_streams_promptly():
    p = OutputParser(True, None)
    assert p.feed("Thinking about it") == [Delta("reasoning", "Thinking about it")]
    assert p.feed(" more </thi") == [Delta("reasoning", " more ")]
    assert p.feed("nk>Answer") == [Delta("content", "Answer")]


def test_cut_call_header_is_not_completed():
    """A call whose header streamed but that max_tokens cut off gets no arguments and is not assembled."""
    p = OutputParser(False, TOOLS)
    deltas = p.feed(block(invoke("bash", param("command", "ls")))[:-40])
    tail, finish = p.finish("length")
    assert finish == "length" and [d.name for d in deltas if d.id] == ["bash"]
    assert assemble(deltas + tail) == (None, None, [])


def test_round_trip_arguments_match_encoder_history():
    """Arguments come out as JSON with Python's default separators, so re-rendering them as history gives the
    exact DSML the model produced (chat_format.md §9.5)."""
    from moebox.server.chat_format import encode_messages

    text = "</think>" + block(invoke("edit", param("path", "a.py"), param("lines", "[1, 2]", False),
                                     param("opts", '{"k": "v"}', False)))
    _, _, calls, _ = parse_completion(text, True, TOOLS)
    prompt = encode_messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "user", "content": "r"}],
                             thinking=False)
    assert "\n\n" + text[len("</think>"):] + "<｜end▁of▁sentence｜>" in prompt


def test_bad_finish_reason_and_feed_after_finish():
    p = OutputParser(True, None)
    with pytest.raises(ValueError):
        p.finish("eos")
    p.finish("stop")
    with pytest.raises(RuntimeError):
        p.feed("x")


def test_stray_dsml_tags_outside_a_block():
    # a bare invoke (the model forgot the block tag) still parses as a call; other stray DSML tags are dropped
    text = "</think>Sure." + "\n\n" + invoke("bash", param("command", "ls"))
    r, c, calls, f = parse_completion(text, True, TOOLS)
    assert (c, _norm(r, c, calls)[2], f) == ("Sure.", [("bash", {"command": "ls"})], "tool_calls")
    text = f"</think>a</{D}parameter>b<{D}bogus x>c{D}d<{D} not a tag < e"
    assert parse_completion(text, True, TOOLS)[1] == "abcd not a tag < e"


ATOMS = ["a", " ", "\n", "\n\n", "<", "</", "<think>", "</think>", "</thi", f"<{D}tool_calls>", f"</{D}tool_calls>",
         f'<{D}invoke name="bash">', f"</{D}invoke>", f'<{D}parameter name="command" string="true">',
         f'<{D}parameter name="days" string="false">', "5", '"x"', f"</{D}parameter>", f"<{D}", EOS, "<｜end", "北",
         "😀", ">"]


def test_random_texts_stream_equals_whole():
    """Seeded fuzz over well- and ill-formed texts: any split gives the whole-text result; no markup leaks."""
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 20)))
        thinking = rng.random() < 0.5
        kw = rng.choice([{"tools": TOOLS}, {"tools": TOOLS, "parallel_tool_calls": False}])
        reason = rng.choice(["stop", "length"])
        whole, wf = _stream(text, thinking, kw, reason, [text])
        r, c, calls = assemble(whole)
        for s in (r or "", c or ""):
            assert "</think>" not in s and "<think>" not in s and D not in s, text
        want = (r, c, [x["function"]["arguments"] for x in calls], [x["function"]["name"] for x in calls], wf)
        n = len(text)
        for pieces in [list(text)] + [
            [text[a:b] for a, b in zip([0] + cuts, cuts + [n])]
            for cuts in (sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 5)))) for _ in range(3))
        ]:
            deltas, f = _stream(text, thinking, kw, reason, pieces)
            r2, c2, calls2 = assemble(deltas)
            assert (r2, c2, [x["function"]["arguments"] for x in calls2], [x["function"]["name"] for x in calls2], f) == want
