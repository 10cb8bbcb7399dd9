"""DeepSeek-V4 prompt encoding (docs: ../shared/docs/chat_format.md §2-§3).

`encode_messages` turns OpenAI-style chat messages into the exact prompt string that the official
DeepSeek-V4-Flash encoder (`encoding/encoding_dsv4.py`) produces, byte for byte; tests compare it with the
official golden files in tests/fixtures/chat/. The semantics are re-implemented here from the spec.

Decisions where the spec leaves a choice (each one is pinned by a test):

* Effort table (§3). ``revision="v4"`` (original): only ``xhigh``/``max`` add text A; ``minimal``/``low``/
  ``medium``/``high``/omitted add nothing. ``revision="v4-0731"``: ``minimal``/``low`` add nothing, ``high`` adds A,
  ``xhigh``/``max`` add text B. Disputed cells, decided: 0731 ``medium`` -> A (DeepSeek's API maps medium to high,
  and high is A in 0731); 0731 omitted -> A (DeepSeek's API and vLLM default to high; the 0731 encoder's own
  default is ``low``, which a client still gets by sending ``reasoning_effort="low"``). ``"none"`` means chat mode
  in both revisions. Any other value is an `EncodingError` (HTTP 400).
* A leading ``developer`` message is treated as the system prompt (§2.4 recommendation: coding agents send their
  system prompt that way, and the official encoder would render it as a user turn and delete it from history
  once the conversation moves on). It is only remapped when something follows it; a developer message anywhere
  else keeps the official user-turn semantics.
* Content given as a list of parts: the text parts are joined with ``"\\n\\n"`` (the same separator the encoder
  uses between blocks of one user turn); a non-text part renders as ``[Unsupported <type>]`` like the encoder does
  for tool results.
* Tool-call ``arguments``: a JSON string (decoded; a JSON string that itself holds a JSON object is decoded twice),
  a dict (used as is, no ``{"arguments": …}`` nesting), ``None``/empty/whitespace (no parameters); anything that
  does not decode to an object is wrapped as ``{"arguments": raw}`` like the original encoder.
* ``response_format`` of type ``text`` adds nothing; any other value is rendered as received in the RF block.
* A conversation must end with a user, tool or developer message (the generation prompt is only added after one);
  anything else is an `EncodingError` unless ``allow_final_assistant=True`` (used to render whole recorded
  conversations such as the golden files).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from moebox.errors import MoeboxError

__all__ = [
    "BOS", "EOS", "USER", "ASSISTANT", "LATEST_REMINDER", "THINK_START", "THINK_END", "DSML",
    "TOOL_CALLS_START", "TOOL_CALLS_END", "EFFORT_TEXT_A", "EFFORT_TEXT_B", "REVISIONS",
    "EncodingError", "encode_messages", "resolve_thinking", "render_tools_block", "effort_prefix",
]

# --- special tokens (｜ is U+FF5C FULLWIDTH VERTICAL LINE, ▁ is U+2581) -------------------------------------
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
LATEST_REMINDER = "<\uff5clatest_reminder\uff5c>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "\uff5cDSML\uff5c"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"
# Internal "quick instruction" task tokens (not reachable from the OpenAI API, but part of the encoder).
TASK_TOKENS = {
    "action": "<\uff5caction\uff5c>",
    "query": "<\uff5cquery\uff5c>",
    "authority": "<\uff5cauthority\uff5c>",
    "domain": "<\uff5cdomain\uff5c>",
    "title": "<\uff5ctitle\uff5c>",
    "read_url": "<\uff5cread_url\uff5c>",
}

# --- effort prefixes (§3) ------------------------------------------------------------------------------------
EFFORT_TEXT_A = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
EFFORT_TEXT_B = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
REVISIONS = ("v4", "v4-0731")
# Key None = reasoning_effort omitted. "none" (chat mode) is handled before the table.
_EFFORT_TABLE: dict[str, dict[str | None, str]] = {
    "v4": {None: "", "minimal": "", "low": "", "medium": "", "high": "", "xhigh": EFFORT_TEXT_A, "max": EFFORT_TEXT_A},
    "v4-0731": {
        None: EFFORT_TEXT_A,  # disputed: API/vLLM default "high" (chosen) vs the 0731 encoder's default "low"
        "minimal": "", "low": "",
        "medium": EFFORT_TEXT_A,  # disputed: "" or A; DeepSeek maps medium -> high
        "high": EFFORT_TEXT_A, "xhigh": EFFORT_TEXT_B, "max": EFFORT_TEXT_B,
    },
}
EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<{d}tool_calls>" block like the following:\n\n'
    "<{d}tool_calls>\n"
    '<{d}invoke name="$TOOL_NAME">\n'
    '<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n'
    "...\n"
    "</{d}invoke>\n"
    '<{d}invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</{d}invoke>\n"
    "</{d}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_RF_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

_ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")


class EncodingError(MoeboxError):
    """The chat request cannot be rendered as a DeepSeek-V4 prompt (the server answers HTTP 400)."""


# --------------------------------------------------------------------------------------------------------------
# helpers


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise EncodingError(f"{what} is not JSON-serialisable: {e}") from None


def _flatten_parts(content: Any, where: str) -> str:
    """Message content as a string: a string as is, None as "", a list of parts joined by "\\n\\n"."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                ptype = part.get("type")
                if ptype in ("text", "input_text", "output_text"):
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise EncodingError(f"{where}.content[{j}]: a text part needs a string 'text'")
                    out.append(text)
                else:
                    out.append(f"[Unsupported {ptype}]")
            else:
                raise EncodingError(f"{where}.content[{j}] must be an object like {{'type': 'text', 'text': ...}}")
        return "\n\n".join(out)
    raise EncodingError(
        f"{where}.content must be a string, null or a list of content parts, got {type(content).__name__}"
    )


def _tool_functions(tools: Any, where: str) -> list[dict]:
    if not isinstance(tools, list):
        raise EncodingError(f"{where} must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise EncodingError(f"{where}[{i}] must be an object like {{'type': 'function', 'function': {{...}}}}")
        fn = tool.get("function", tool if "name" in tool else None)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn.get("name"):
            raise EncodingError(f"{where}[{i}] needs a 'function' object with a non-empty 'name'")
        out.append(fn)
    return out


def render_tools_block(tools: list[dict]) -> str:
    """The §2.3 tools block for OpenAI-style tools; each `function` object is dumped as received."""
    fns = _tool_functions(tools, "tools")
    schemas = "\n".join(_to_json(fn, f"tool {fn['name']!r}") for fn in fns)
    return _TOOLS_TEMPLATE.replace("{d}", DSML).replace("{schemas}", schemas)


def effort_prefix(reasoning_effort: str | None, revision: str = "v4") -> str:
    """The effort text placed right after BOS in thinking mode (§3); validates both arguments."""
    if revision not in _EFFORT_TABLE:
        raise EncodingError(f"unknown chat-format revision {revision!r}; expected one of {', '.join(REVISIONS)}")
    key = _normalise_effort(reasoning_effort)
    if key == "none":
        return ""
    return _EFFORT_TABLE[revision][key]


def _normalise_effort(reasoning_effort: Any) -> str | None:
    if reasoning_effort is None:
        return None
    if not isinstance(reasoning_effort, str) or reasoning_effort.strip().lower() not in EFFORT_VALUES:
        raise EncodingError(
            f"reasoning_effort must be one of {', '.join(EFFORT_VALUES)} (or omitted), got {reasoning_effort!r}"
        )
    return reasoning_effort.strip().lower()


def _decode_arguments(arguments: Any) -> dict:
    """Tool-call arguments as a dict (see the module docstring for the accepted forms)."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    if not isinstance(arguments, str):
        return {"arguments": arguments}
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    if isinstance(value, str):  # double-encoded JSON
        try:
            inner = json.loads(value)
        except ValueError:
            inner = None
        if isinstance(inner, dict):
            return inner
    if isinstance(value, dict):
        return value
    return {"arguments": arguments}


def _render_tool_calls(tool_calls: list[dict], where: str) -> str:
    invokes = []
    for j, tc in enumerate(tool_calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EncodingError(f"{where}.tool_calls[{j}] needs a 'function' object with a string 'name'")
        params = []
        for key, value in _decode_arguments(fn.get("arguments")).items():
            if isinstance(value, str):
                params.append(f'<{DSML}parameter name="{key}" string="true">{value}{PARAMETER_END}')
            else:
                v = _to_json(value, f"{where}.tool_calls[{j}] argument {key!r}")
                params.append(f'<{DSML}parameter name="{key}" string="false">{v}{PARAMETER_END}')
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return "\n\n" + TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


# --------------------------------------------------------------------------------------------------------------
# preprocessing (§2.1)


def _validate_and_normalise(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise EncodingError(f"{where} must be an object with a 'role'")
        role = msg.get("role")
        if role not in _ROLES:
            raise EncodingError(f"{where}: unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        m = copy.deepcopy(msg)
        if role == "assistant":
            rc = m.get("reasoning_content")
            if rc is None:
                rc = m.get("reasoning")
            if rc is not None and not isinstance(rc, str):
                raise EncodingError(f"{where}.reasoning_content must be a string")
            m["reasoning_content"] = rc
            m.pop("reasoning", None)
            tcs = m.get("tool_calls")
            if tcs is not None and not isinstance(tcs, list):
                raise EncodingError(f"{where}.tool_calls must be a list")
        if role == "tool":
            c = m.get("content")
            if c is None:
                m["content"] = ""
            elif isinstance(c, list):
                if not all(isinstance(p, dict) for p in c):
                    raise EncodingError(f"{where}.content parts must be objects")
            elif not isinstance(c, str):
                raise EncodingError(f"{where}.content must be a string or a list of content parts")
        else:
            m["content"] = _flatten_parts(m.get("content"), where)
        if "task" in m and m["task"] is not None and m["task"] not in TASK_TOKENS:
            raise EncodingError(f"{where}: unknown task {m['task']!r}")
        if m.get("tools"):
            _tool_functions(m["tools"], f"{where}.tools")
        m["_where"] = where
        out.append(m)
    return out


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool results and user texts become blocks of user turns; consecutive ones share one turn."""
    merged: list[dict] = []
    for m in messages:
        role = m["role"]
        prev = merged[-1] if merged else None
        prev_user = prev is not None and prev["role"] == "user" and "blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "id": m.get("tool_call_id") or "", "content": m["content"]}
            if prev_user:
                prev["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block], "_where": m["_where"]})
        elif role == "user":
            block = {"type": "text", "text": m["content"]}
            if prev_user and prev.get("task") is None:
                prev["blocks"].append(block)
            else:
                new = {"role": "user", "blocks": [block], "_where": m["_where"]}
                if m.get("task") is not None:
                    new["task"] = m["task"]
                merged.append(new)
        else:
            merged.append(m)
    return merged


def _sort_tool_results(messages: list[dict]) -> None:
    """Reorder each user turn's tool results to follow the latest assistant's tool_calls order (in place)."""
    order: dict[str, int] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {}
            for k, tc in enumerate(m["tool_calls"]):
                tc_id = (tc.get("id") or (tc.get("function") or {}).get("id") or "") if isinstance(tc, dict) else ""
                if tc_id:
                    order[tc_id] = k
        elif m["role"] == "user" and m.get("blocks"):
            results = [b for b in m["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))  # stable; unknown id -> 0
                m["blocks"] = [next(ranked) if b["type"] == "tool_result" else b for b in m["blocks"]]


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_history_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user/developer turn: strip assistant reasoning and delete developer messages."""
    last = _last_user_index(messages)
    out = []
    for i, m in enumerate(messages):
        if i >= last or m["role"] in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            m = dict(m)
            m["reasoning_content"] = None
            out.append(m)
        # developer before the last user turn: deleted
    return out


# --------------------------------------------------------------------------------------------------------------
# rendering (§2.2)


def _render_user_blocks(m: dict) -> str:
    parts = []
    for b in m["blocks"]:
        if b["type"] == "text":
            parts.append(b["text"])
        else:
            c = b["content"]
            if isinstance(c, list):
                c = "\n\n".join(
                    (p.get("text") or "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]" for p in c
                )
            parts.append(f"<tool_result>{c}</tool_result>")
    return "\n\n".join(parts)


def _system_extras(m: dict) -> str:
    out = ""
    if m.get("tools"):
        out += "\n\n" + render_tools_block(m["tools"])
    rf = m.get("response_format")
    if rf:
        out += "\n\n" + _RF_TEMPLATE.format(schema=_to_json(rf, f"{m['_where']}.response_format"))
    return out


def _render(i: int, msgs: list[dict], thinking: bool, drop: bool, prefix: str) -> str:
    m = msgs[i]
    role = m["role"]
    last_user = _last_user_index(msgs)
    out = prefix if i == 0 and thinking else ""

    if role == "system":
        out += m["content"] + _system_extras(m)
    elif role == "developer":
        out += USER + m["content"] + _system_extras(m)
    elif role == "user":
        out += USER + _render_user_blocks(m)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + m["content"]
    elif role == "assistant":
        tc = _render_tool_calls(m["tool_calls"], m["_where"]) if m.get("tool_calls") else ""
        after_task = i > 0 and msgs[i - 1].get("task") is not None
        reasoning = ""
        if thinking and not after_task and (not drop or i > last_user):
            reasoning = (m.get("reasoning_content") or "") + THINK_END
        out += reasoning + m["content"] + tc + EOS

    # Generation prompt: only before an assistant/latest_reminder message, or at the very end.
    if i + 1 < len(msgs) and msgs[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    task = m.get("task")
    if task is not None:
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        open_think = thinking and (not drop or i >= last_user)
        out += ASSISTANT + (THINK_START if open_think else THINK_END)
    return out


def encode_messages(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = True,
    reasoning_effort: str | None = None,
    revision: str = "v4",
    drop_thinking: bool = True,
    response_format: dict | None = None,
    *,
    allow_final_assistant: bool = False,
) -> str:
    """Render OpenAI-style `messages` (+ request-level `tools`/`response_format`) as a DeepSeek-V4 prompt.

    Raises `EncodingError` for input the model cannot be prompted with (unknown role, empty messages, empty
    developer content, a conversation that does not end with a user/tool/developer message, bad effort, ...).
    """
    if revision not in _EFFORT_TABLE:
        raise EncodingError(f"unknown chat-format revision {revision!r}; expected one of {', '.join(REVISIONS)}")
    effort = _normalise_effort(reasoning_effort)
    if effort == "none":
        thinking = False
    prefix = _EFFORT_TABLE[revision][effort] if thinking else ""

    msgs = _validate_and_normalise(messages)

    # A leading developer message is the agent's system prompt (§2.4); see the module docstring.
    if msgs[0]["role"] == "developer" and len(msgs) > 1:
        msgs[0]["role"] = "system"
    for m in msgs:
        if m["role"] == "developer" and not m["content"]:
            raise EncodingError(f"{m['_where']}: a developer message needs non-empty content")

    if response_format is not None and not isinstance(response_format, dict):
        raise EncodingError("response_format must be an object")
    rf = response_format if response_format and response_format.get("type") != "text" else None
    if tools is not None:
        _tool_functions(tools, "tools")
    if tools or rf:
        if msgs[0]["role"] not in ("system", "developer"):
            msgs.insert(0, {"role": "system", "content": "", "_where": "system (inserted for tools)"})
        if tools:
            msgs[0]["tools"] = tools
        if rf:
            msgs[0]["response_format"] = rf

    msgs = _merge_tool_messages(msgs)
    _sort_tool_results(msgs)

    final = msgs[-1]["role"]
    if final not in ("user", "developer") and not allow_final_assistant:
        raise EncodingError(
            f"the conversation must end with a user, tool or developer message, not {final!r} "
            "(continuing a final assistant message is not supported)"
        )

    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_history_thinking(msgs)

    return BOS + "".join(_render(i, msgs, thinking, drop, prefix) for i in range(len(msgs)))


# --------------------------------------------------------------------------------------------------------------
# thinking switch (§2.4)


def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise EncodingError(f"{what} must be a boolean, got {value!r}")


def resolve_thinking(
    chat_template_kwargs: dict | None, thinking_field: Any, reasoning_effort: str | None
) -> tuple[bool, str | None]:
    """Decide thinking mode and effort from a request (§2.4 priority); thinking is ON by default.

    1. ``chat_template_kwargs.thinking`` (or ``.enable_thinking``);
    2. DeepSeek's ``thinking: {"type": "enabled" | "disabled"}`` (a bare boolean is accepted too);
    3. ``reasoning_effort: "none"`` => chat mode.
    The returned effort is the normalised `reasoning_effort` (None when omitted or "none").
    """
    effort = _normalise_effort(reasoning_effort)
    thinking: bool | None = None
    kw = chat_template_kwargs or {}
    if not isinstance(kw, dict):
        raise EncodingError("chat_template_kwargs must be an object")
    for key in ("thinking", "enable_thinking"):
        if kw.get(key) is not None:
            thinking = _as_bool(kw[key], f"chat_template_kwargs.{key}")
            break
    if thinking is None and thinking_field is not None:
        if isinstance(thinking_field, bool):
            thinking = thinking_field
        elif isinstance(thinking_field, dict):
            kind = thinking_field.get("type")
            if kind == "enabled":
                thinking = True
            elif kind == "disabled":
                thinking = False
            elif kind not in (None, "auto"):
                raise EncodingError(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}")
        else:
            raise EncodingError('thinking must be an object like {"type": "enabled"}')
    if thinking is None:
        thinking = effort != "none"
    return thinking, (None if effort == "none" else effort)
