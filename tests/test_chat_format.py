"""DeepSeek-V4 prompt encoder: official golden files byte for byte, plus hand-written vectors for every rule.

Every expected string here is typed out from ../shared/docs/chat_format.md (§2-§3, §10), never produced by the
encoder. Golden files and their source: tests/fixtures/chat/README.md.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from moebox.errors import MoeboxError
from moebox.server import chat_format as cf
from moebox.server.chat_format import EncodingError, encode_messages, resolve_thinking

FIX = Path(__file__).parent / "fixtures" / "chat"

# --- literals typed from the spec ------------------------------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A_ = "<｜Assistant｜>"
LR = "<｜latest_reminder｜>"

TEXT_A = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
TEXT_B = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

TOOLS_HEAD = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

# A tool whose function object has an unusual key order and non-ASCII text (kept as received).
TOOL_LS = {"type": "function", "function": {"parameters": {"type": "object", "properties": {}}, "name": "ls", "description": "列出文件"}}
TOOL_LS_LINE = '{"parameters": {"type": "object", "properties": {}}, "name": "ls", "description": "列出文件"}'
TOOLS_LS_BLOCK = TOOLS_HEAD + TOOL_LS_LINE + TOOLS_TAIL


def user(text):
    return {"role": "user", "content": text}


def call(name, arguments, id=None):
    tc = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id is not None:
        tc["id"] = id
    return tc


# --- constants --------------------------------------------------------------------------------------------------


def test_special_token_constants():
    assert cf.BOS == BOS and cf.EOS == EOS and cf.USER == U and cf.ASSISTANT == A_ and cf.LATEST_REMINDER == LR
    assert cf.THINK_START == "<think>" and cf.THINK_END == "</think>" and cf.DSML == "｜DSML｜"
    assert "\uff5c" in BOS and "\u2581" in BOS  # typed with the right code points
    assert cf.EFFORT_TEXT_A == TEXT_A and cf.EFFORT_TEXT_B == TEXT_B and "\u2014" in TEXT_B


def test_constants_match_the_tokenizer_special_tokens():
    from moebox.weights.tokenizer import SPECIAL_TOKENS

    vocab = {tok for tok, _ in SPECIAL_TOKENS}
    assert {cf.BOS, cf.EOS, cf.USER, cf.ASSISTANT, cf.LATEST_REMINDER, cf.THINK_START, cf.THINK_END, cf.DSML} <= vocab
    assert set(cf.TASK_TOKENS.values()) <= vocab


def test_tools_block_text():
    assert cf.render_tools_block([TOOL_LS]) == TOOLS_LS_BLOCK


# --- golden files -------------------------------------------------------------------------------------------------


def _load(name):
    return json.loads((FIX / name).read_text(encoding="utf-8"))


def _gold(name):
    return (FIX / name).read_bytes().decode("utf-8")


def _rename(messages, old, new):
    out = copy.deepcopy(messages)
    for m in out:
        if old in m:
            m[new] = m.pop(old)
    return out


def _golden_cases():
    td = _load("test_input_1.json")
    yield "1", td["messages"], dict(tools=td["tools"]), "test_output_1.txt"
    yield "2", _load("test_input_2.json"), {}, "test_output_2.txt"
    yield "3", _load("test_input_3.json"), {}, "test_output_3.txt"
    yield "4", _load("test_input_4.json"), dict(thinking=False), "test_output_4.txt"


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
@pytest.mark.parametrize("case", list(_golden_cases()), ids=lambda c: f"case{c[0]}")
def test_golden_files(case, key):
    _, messages, kw, out_name = case
    messages = _rename(messages, "reasoning", key)  # vLLM's copies say "reasoning", the official ones "reasoning_content"
    got = encode_messages(messages, allow_final_assistant=True, **kw)
    assert got.encode("utf-8") == (FIX / out_name).read_bytes()


def test_golden_1_tools_in_an_inserted_system_message():
    """vLLM's other copy of output 1: tools on an empty system message in front; the real system prompt then
    follows as bare text (a later system message has no role token)."""
    td = _load("test_input_1.json")
    messages = [{"role": "system", "content": "", "tools": td["tools"]}] + td["messages"]
    got = encode_messages(messages, allow_final_assistant=True)
    assert got == _gold("test_output_1_vllm_request_tools.txt")


def test_golden_prompt_prefixes_are_generation_prompts():
    """Cutting a golden conversation before its last assistant reply gives the exact golden prefix."""
    td = _load("test_input_2.json")
    gold = _gold("test_output_2.txt")
    prompt = encode_messages(td[:-1])
    assert gold.startswith(prompt) and prompt.endswith(A_ + "<think>")
    td3 = _load("test_input_3.json")
    prompt3 = encode_messages(td3[:-1])
    gold3 = _gold("test_output_3.txt")
    assert gold3.startswith(prompt3) and prompt3.endswith("<tool_result>[0]</tool_result>" + A_ + "<think>")


# --- single turn, thinking / chat, effort ---------------------------------------------------------------------


def test_single_turn_thinking_and_chat():
    assert encode_messages([user("Hi")]) == BOS + U + "Hi" + A_ + "<think>"
    assert encode_messages([user("Hi")], thinking=False) == BOS + U + "Hi" + A_ + "</think>"


@pytest.mark.parametrize(
    "revision,effort,prefix",
    [
        ("v4", None, ""), ("v4", "minimal", ""), ("v4", "low", ""), ("v4", "medium", ""), ("v4", "high", ""),
        ("v4", "xhigh", TEXT_A), ("v4", "max", TEXT_A), ("v4", "MAX", TEXT_A),
        ("v4-0731", "minimal", ""), ("v4-0731", "low", ""),
        ("v4-0731", "medium", TEXT_A),  # disputed cell: decided A (medium -> high)
        ("v4-0731", "high", TEXT_A),
        ("v4-0731", None, TEXT_A),  # disputed cell: omitted = high (API/vLLM default), not the encoder's "low"
        ("v4-0731", "xhigh", TEXT_B), ("v4-0731", "max", TEXT_B),
    ],
)
def test_effort_prefix_table(revision, effort, prefix):
    got = encode_messages([user("Hi")], reasoning_effort=effort, revision=revision)
    assert got == BOS + prefix + U + "Hi" + A_ + "<think>"


@pytest.mark.parametrize("revision", ["v4", "v4-0731"])
def test_effort_none_means_chat_and_chat_has_no_prefix(revision):
    assert encode_messages([user("Hi")], reasoning_effort="none", revision=revision) == BOS + U + "Hi" + A_ + "</think>"
    assert encode_messages([user("Hi")], thinking=False, reasoning_effort="max", revision=revision) == (
        BOS + U + "Hi" + A_ + "</think>"
    )


def test_effort_prefix_goes_before_the_system_prompt():
    got = encode_messages([{"role": "system", "content": "S"}, user("Hi")], reasoning_effort="max")
    assert got == BOS + TEXT_A + "S" + U + "Hi" + A_ + "<think>"
    got = encode_messages([{"role": "system", "content": "S"}, user("Hi")], reasoning_effort="max", revision="v4-0731")
    assert got == BOS + TEXT_B + "S" + U + "Hi" + A_ + "<think>"


# --- tool results: merge and sort -------------------------------------------------------------------------------

TC_AB = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="b">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)


def _ab_history():
    return [
        user("q"),
        {"role": "assistant", "content": "", "tool_calls": [call("a", '{"x": 1}', "c1"), call("b", "{}", "c2")]},
    ]


def test_tool_results_merge_into_one_user_turn_sorted_by_call_order():
    msgs = _ab_history() + [
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        user("more"),
    ]
    want = (
        BOS + U + "q" + A_ + "</think>" + TC_AB + EOS
        + U + "<tool_result>r1</tool_result>\n\n<tool_result>r2</tool_result>\n\nmore" + A_ + "<think>"
    )
    assert encode_messages(msgs) == want


def test_tool_result_sort_keeps_text_slots_and_unknown_ids_sort_first():
    msgs = _ab_history() + [
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        user("note"),
        {"role": "tool", "tool_call_id": "zzz", "content": "rz"},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
    ]
    # order keys: c2 -> 1, zzz -> 0 (unknown), c1 -> 0; a stable sort gives zzz, c1, c2 in the tool slots.
    want_turn = (
        U + "<tool_result>rz</tool_result>\n\nnote\n\n<tool_result>r1</tool_result>\n\n<tool_result>r2</tool_result>"
    )
    assert encode_messages(msgs, thinking=False) == (
        BOS + U + "q" + A_ + "</think>" + TC_AB + EOS + want_turn + A_ + "</think>"
    )


def test_tool_result_without_id_and_list_content():
    msgs = [
        user("q"),
        {"role": "assistant", "tool_calls": [call("b", "{}")]},
        {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {}}]},
    ]
    tc = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="b">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert encode_messages(msgs, thinking=False) == (
        BOS + U + "q" + A_ + "</think>" + tc + EOS + U + "<tool_result>x\n\n[Unsupported image_url]</tool_result>"
        + A_ + "</think>"
    )


def test_consecutive_user_messages_merge():
    assert encode_messages([user("a"), user("b")]) == BOS + U + "a\n\nb" + A_ + "<think>"


# --- history reasoning ------------------------------------------------------------------------------------------

HIST = [user("Hello"), {"role": "assistant", "reasoning_content": "r1", "content": "Hi"}, user("Q")]


def test_history_reasoning_dropped_without_tools():
    assert encode_messages(HIST) == BOS + U + "Hello" + A_ + "</think>Hi" + EOS + U + "Q" + A_ + "<think>"


def test_history_reasoning_kept_with_tools():
    want = BOS + "\n\n" + TOOLS_LS_BLOCK + U + "Hello" + A_ + "<think>r1</think>Hi" + EOS + U + "Q" + A_ + "<think>"
    assert encode_messages(HIST, tools=[TOOL_LS]) == want


def test_history_reasoning_kept_with_drop_thinking_off_and_missing_reasoning_tolerated():
    assert encode_messages(HIST, drop_thinking=False) == (
        BOS + U + "Hello" + A_ + "<think>r1</think>Hi" + EOS + U + "Q" + A_ + "<think>"
    )
    msgs = [user("Hello"), {"role": "assistant", "content": "Hi"}, user("Q")]
    assert encode_messages(msgs, drop_thinking=False) == (
        BOS + U + "Hello" + A_ + "<think></think>Hi" + EOS + U + "Q" + A_ + "<think>"
    )


def test_reasoning_key_alias_and_chat_mode_history():
    alias = [user("Hello"), {"role": "assistant", "reasoning": "r1", "content": "Hi"}, user("Q")]
    assert encode_messages(alias, drop_thinking=False) == encode_messages(HIST, drop_thinking=False)
    assert encode_messages(HIST, thinking=False) == BOS + U + "Hello" + A_ + "</think>Hi" + EOS + U + "Q" + A_ + "</think>"


# --- developer, latest_reminder, system -----------------------------------------------------------------------


def test_developer_turn_is_a_user_turn_and_is_deleted_from_history():
    msgs = [{"role": "system", "content": "S"}, user("u1"), {"role": "assistant", "content": "a1"},
            {"role": "developer", "content": "D"}]
    assert encode_messages(msgs) == BOS + "S" + U + "u1" + A_ + "</think>a1" + EOS + U + "D" + A_ + "<think>"
    msgs = [user("u1"), {"role": "developer", "content": "D1"}, {"role": "assistant", "content": "a1"}, user("u2")]
    assert encode_messages(msgs) == BOS + U + "u1" + A_ + "</think>a1" + EOS + U + "u2" + A_ + "<think>"
    # with drop_thinking off, it stays (a user turn that merges nothing: two role tokens in a row)
    assert encode_messages(msgs, drop_thinking=False) == (
        BOS + U + "u1" + U + "D1" + A_ + "<think></think>a1" + EOS + U + "u2" + A_ + "<think>"
    )


def test_developer_with_tools_block():
    msgs = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D", "tools": [TOOL_LS]}]
    assert encode_messages(msgs) == BOS + "S" + U + "D\n\n" + TOOLS_LS_BLOCK + A_ + "<think>"


def test_leading_developer_is_the_system_prompt():
    msgs = [{"role": "developer", "content": "You are X"}, user("Hi")]
    assert encode_messages(msgs) == BOS + "You are X" + U + "Hi" + A_ + "<think>"
    assert encode_messages(msgs, tools=[TOOL_LS]) == BOS + "You are X\n\n" + TOOLS_LS_BLOCK + U + "Hi" + A_ + "<think>"
    # a lone developer message is the user's turn
    assert encode_messages([{"role": "developer", "content": "D"}]) == BOS + U + "D" + A_ + "<think>"


def test_latest_reminder():
    msgs = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "R"}, user("Hi")]
    assert encode_messages(msgs) == BOS + "S" + LR + "R" + U + "Hi" + A_ + "<think>"
    msgs = [user("Hi"), {"role": "assistant", "content": "A"}, {"role": "latest_reminder", "content": "R"}, user("Q")]
    assert encode_messages(msgs) == BOS + U + "Hi" + A_ + "</think>A" + EOS + LR + "R" + U + "Q" + A_ + "<think>"


def test_later_system_message_is_bare_text():
    msgs = [{"role": "system", "content": "S1"}, user("Hi"), {"role": "assistant", "content": "A"},
            {"role": "system", "content": "S2"}, user("Q")]
    assert encode_messages(msgs, thinking=False) == (
        BOS + "S1" + U + "Hi" + A_ + "</think>A" + EOS + "S2" + U + "Q" + A_ + "</think>"
    )


def test_request_tools_attach_to_the_system_message_or_insert_one():
    sys_msgs = [{"role": "system", "content": "S", "tools": [{"type": "function", "function": {"name": "old"}}]}, user("Hi")]
    assert encode_messages(sys_msgs, tools=[TOOL_LS]) == BOS + "S\n\n" + TOOLS_LS_BLOCK + U + "Hi" + A_ + "<think>"
    assert encode_messages([user("Hi")], tools=[TOOL_LS], thinking=False) == (
        BOS + "\n\n" + TOOLS_LS_BLOCK + U + "Hi" + A_ + "</think>"
    )
    assert encode_messages([user("Hi")], tools=[]) == BOS + U + "Hi" + A_ + "<think>"


def test_response_format_block():
    rf = {"type": "json_object"}
    want_rf = '## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{"type": "json_object"}'
    assert encode_messages([user("Hi")], response_format=rf) == BOS + "\n\n" + want_rf + U + "Hi" + A_ + "<think>"
    assert encode_messages([{"role": "system", "content": "S"}, user("Hi")], tools=[TOOL_LS], response_format=rf) == (
        BOS + "S\n\n" + TOOLS_LS_BLOCK + "\n\n" + want_rf + U + "Hi" + A_ + "<think>"
    )
    assert encode_messages([user("Hi")], response_format={"type": "text"}) == BOS + U + "Hi" + A_ + "<think>"


# --- assistant tool calls ---------------------------------------------------------------------------------------


def _tc_prompt(arguments):
    return encode_messages([user("q"), {"role": "assistant", "tool_calls": [call("f", arguments)]}, user("ok")],
                           thinking=False)


def _tc_want(params):
    inner = "\n".join(params)
    return (BOS + U + "q" + A_ + "</think>" + '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n' + inner
            + "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS + U + "ok" + A_ + "</think>")


ARGS = {"a": "s <x> \"q\"\nline", "n": 1.5, "o": {"k": [1, "x"]}, "b": True, "z": None, "i": 7}
ARGS_PARAMS = [
    '<｜DSML｜parameter name="a" string="true">s <x> "q"\nline</｜DSML｜parameter>',
    '<｜DSML｜parameter name="n" string="false">1.5</｜DSML｜parameter>',
    '<｜DSML｜parameter name="o" string="false">{"k": [1, "x"]}</｜DSML｜parameter>',
    '<｜DSML｜parameter name="b" string="false">true</｜DSML｜parameter>',
    '<｜DSML｜parameter name="z" string="false">null</｜DSML｜parameter>',
    '<｜DSML｜parameter name="i" string="false">7</｜DSML｜parameter>',
]


def test_tool_call_params_string_raw_others_json():
    assert _tc_prompt(json.dumps(ARGS)) == _tc_want(ARGS_PARAMS)


def test_tool_call_arguments_dict_equals_string():
    assert _tc_prompt(ARGS) == _tc_prompt(json.dumps(ARGS)) == _tc_prompt(json.dumps(ARGS, separators=(",", ":")))
    assert _tc_prompt(json.dumps(json.dumps(ARGS))) == _tc_want(ARGS_PARAMS)  # double-encoded


def test_tool_call_undecodable_and_empty_arguments():
    assert _tc_prompt("not json") == _tc_want(['<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>'])
    assert _tc_prompt("") == _tc_want([""]) == _tc_prompt("{}") == _tc_prompt(None)


def test_non_ascii_kept_raw():
    got = _tc_prompt('{"city": "\\u5317\\u4eac", "tags": ["é", "😀"]}')
    assert got == _tc_want([
        '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>',
        '<｜DSML｜parameter name="tags" string="false">["é", "😀"]</｜DSML｜parameter>',
    ])
    assert encode_messages([user("Hi")], tools=[TOOL_LS]).count("列出文件") == 1


def test_empty_tool_calls_render_nothing_and_content_and_calls_together():
    msgs = [user("q"), {"role": "assistant", "content": "x", "tool_calls": []}, user("r")]
    assert encode_messages(msgs, thinking=False) == BOS + U + "q" + A_ + "</think>x" + EOS + U + "r" + A_ + "</think>"
    msgs = [user("q"), {"role": "assistant", "content": "Let me look.", "tool_calls": [call("b", "{}", "c")]},
            {"role": "tool", "tool_call_id": "c", "content": "done"}]
    assert encode_messages(msgs, thinking=False) == (
        BOS + U + "q" + A_ + "</think>Let me look."
        + '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="b">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS
        + U + "<tool_result>done</tool_result>" + A_ + "</think>"
    )


def test_content_parts_joined_with_blank_line():
    msgs = [{"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "b"}]}]
    assert encode_messages(msgs) == BOS + "S1\n\nS2" + U + "a\n\n[Unsupported image_url]\n\nb" + A_ + "<think>"


def test_task_tokens():
    msgs = [user("x"), {"role": "user", "content": "t", "task": "action"}]
    # a user message with a task merges into the previous user turn (and loses the task), as in the encoder
    assert encode_messages(msgs, thinking=False) == BOS + U + "x\n\nt" + A_ + "</think>"
    assert encode_messages([{"role": "user", "content": "t", "task": "title"}]) == BOS + U + "t" + "<｜title｜>"


# --- thinking switch --------------------------------------------------------------------------------------------


def test_resolve_thinking_priority():
    assert resolve_thinking(None, None, None) == (True, None)
    assert resolve_thinking({}, None, "high") == (True, "high")
    assert resolve_thinking(None, None, "none") == (False, None)
    assert resolve_thinking(None, {"type": "disabled"}, None) == (False, None)
    assert resolve_thinking(None, {"type": "enabled"}, "none") == (True, None)
    assert resolve_thinking({"thinking": False}, {"type": "enabled"}, "max") == (False, "max")
    assert resolve_thinking({"enable_thinking": True}, {"type": "disabled"}, "none") == (True, None)
    assert resolve_thinking({"thinking": None, "enable_thinking": False}, None, None) == (False, None)
    assert resolve_thinking({"thinking": "false"}, None, None) == (False, None)
    assert resolve_thinking(None, False, None) == (False, None)
    assert resolve_thinking(None, None, "XHigh") == (True, "xhigh")
    for bad in [({"thinking": "maybe"}, None, None), (None, {"type": "sometimes"}, None), (None, None, "ultra"),
                (None, "yes", None)]:
        with pytest.raises(EncodingError):
            resolve_thinking(*bad)


# --- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages,kw,match",
    [
        ([], {}, "non-empty list"),
        (None, {}, "non-empty list"),
        ([{"role": "wizard", "content": "x"}], {}, "unknown role 'wizard'"),
        ([{"content": "x"}], {}, "unknown role None"),
        (["hi"], {}, "must be an object"),
        ([user("q"), {"role": "assistant", "content": "a"}], {}, "must end with a user, tool or developer"),
        ([user("q"), {"role": "latest_reminder", "content": "r"}], {}, "must end with"),
        ([user("q"), {"role": "developer", "content": ""}], {}, "developer message needs non-empty content"),
        ([user("q")], {"reasoning_effort": "ultra"}, "reasoning_effort must be one of"),
        ([user("q")], {"revision": "v4.1"}, "unknown chat-format revision"),
        ([{"role": "user", "content": 5}], {}, "content must be"),
        ([user("q")], {"tools": [{"type": "function"}]}, "needs a 'function' object"),
        ([user("q"), {"role": "assistant", "tool_calls": [{"id": "x"}]}, user("r")], {}, "tool_calls\\[0\\]"),
    ],
)
def test_encoding_errors(messages, kw, match):
    with pytest.raises(EncodingError, match=match) as ei:
        encode_messages(messages, **kw)
    assert isinstance(ei.value, MoeboxError)


def test_input_is_not_modified():
    td = _load("test_input_1.json")
    before = copy.deepcopy(td)
    encode_messages(td["messages"], tools=td["tools"], allow_final_assistant=True)
    assert td == before


def test_request_tools_render_in_the_clients_key_order():
    """The server validates tools but renders them as sent: DeepSeek's encoder dumps tools as received, so a
    pydantic round trip (fields in model order) would change the prompt."""
    import pydantic

    from moebox.server.protocol import ChatCompletionRequest
    function = {"parameters": {"type": "object", "properties": {"q": {"type": "string"}}}, "name": "find",
                "description": "look something up"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"function": function, "type": "function"}]}
    req = ChatCompletionRequest.model_validate(body)
    msgs = [{"role": "user", "content": "hi"}]
    assert encode_messages(msgs, tools=req.tools) == encode_messages(msgs, tools=body["tools"])
    reordered = [{"type": "function", "function": {k: function[k] for k in ("name", "description", "parameters")}}]
    assert encode_messages(msgs, tools=reordered) != encode_messages(msgs, tools=body["tools"])
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({**body, "tools": [{"type": "function", "function": {"name": ""}}]})
