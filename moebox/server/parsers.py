"""Incremental parser for DeepSeek-V4 output: reasoning / content / DSML tool calls (chat_format.md §4-§5).

One state machine serves the streaming and the non-streaming paths (`parse_completion` feeds the whole text
at once), so both give the same result however the text is split. Generated text looks like::

    thinking: REASONING "</think>" CONTENT ["\\n\\n" <｜DSML｜tool_calls> ... </｜DSML｜tool_calls>]
    chat:     CONTENT ["\\n\\n" <｜DSML｜tool_calls> ... </｜DSML｜tool_calls>]

States REASONING -> CONTENT -> TOOLS (-> INVOKE -> TOOLS ...) -> CONTENT (text after a closed block) / DONE.
The thinking flag only picks the first state. Rules:

* Text that could be the start of a marker (``</think>``, ``<think>``, ``<｜DSML｜tool_calls>``, EOS) is held back
  until it is decided; so are trailing newlines while a tool block may follow (the ``"\\n\\n"`` separator before
  the block is never emitted: trailing newlines right before a block are dropped).
* Stray ``<think>`` / ``</think>`` in content (and ``<think>`` in reasoning) are removed; the EOS token text, if a
  caller passes it, ends the parse. A tool block inside the reasoning (no ``</think>`` yet) ends the reasoning
  there (vLLM rule). Outside a block, a bare ``<｜DSML｜invoke name="…">`` also starts the tool calls, any other
  DSML tag is dropped, and a DSML tag cut off by the end of output is dropped with its separator; so reasoning
  and content never contain ``<think>``, ``</think>`` or ``｜DSML｜`` (a seeded fuzz test checks this).
* A tool call is announced (index, ``call_<24 hex>`` id, name, arguments ``""``) as soon as its invoke header
  parses; its arguments follow as one chunk of valid JSON when the invoke closes. Values are coerced with the
  tool's JSON schema (string="false" values are JSON-decoded; "5" -> 5 for an integer property; a property typed
  string keeps the raw text; a lone ``arguments``/``input`` wrapper not in the schema is unwrapped).
* An invoke cut off by the end of output is dropped (nothing of it shows as content). Its header may already have
  been streamed: it never gets an arguments chunk, and the finish reason then is "length" (or "stop").
  `assemble` (and so `parse_completion`) keeps only calls whose arguments arrived.
* finish_reason: "length" if max_tokens cut the output anywhere but right after a closed tool block; else
  "tool_calls" if at least one call completed; else "stop".
* ``tool_choice="none"``: no tool parsing at all (any DSML text stays content). ``parallel_tool_calls=False``:
  calls after the first are parsed but not emitted. "required"/named choices parse like "auto" (enforcing them
  is the server's job).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from moebox.server.chat_format import DSML, EOS, THINK_END, THINK_START, TOOL_CALLS_END, TOOL_CALLS_START

__all__ = ["Delta", "OutputParser", "assemble", "parse_completion", "new_call_id"]

_INVOKE_OPEN = f"<{DSML}invoke"
_INVOKE_END = f"</{DSML}invoke>"
_PARAM_OPEN = f"<{DSML}parameter"
_PARAM_END = f"</{DSML}parameter>"
_INVOKE_HEADER = re.compile(re.escape(_INVOKE_OPEN) + r'\s+name="([^"]*)"\s*>')
_DSML_OPEN = f"<{DSML}"
_DSML_CLOSE = f"</{DSML}"
_MAX_TAG = 256  # a DSML tag longer than this without its ">" is not a tag
_PARAM_HEADER = re.compile(re.escape(_PARAM_OPEN) + r'\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>')

_REASONING, _CONTENT, _TOOLS, _INVOKE, _DONE = "reasoning", "content", "tools", "invoke", "done"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Delta:
    """One piece of output: reasoning text, content text, or a tool-call event.

    A tool-call event carries `index`; the first event of a call also carries `id` and `name` (with
    ``arguments == ""``), the second carries the complete `arguments` JSON text.
    """

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


# --------------------------------------------------------------------------------------------------------------
# schema coercion


def _schema_types(schema: Any) -> set[str] | None:
    """The JSON types a schema allows, or None if it does not say."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: set[str] = set()
            for sub in schema[key]:
                st = _schema_types(sub)
                if st is None:
                    return None
                out |= st
            return out
    if "enum" in schema and isinstance(schema["enum"], list):
        return {_json_type(v) for v in schema["enum"]}
    return None


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _fits(v: Any, types: set[str]) -> bool:
    t = _json_type(v)
    return t in types or (t == "integer" and "number" in types) or (
        t == "number" and "integer" in types and float(v).is_integer()
    )


def _coerce_text(raw: str, types: set[str]) -> tuple[bool, Any]:
    """Convert a text value to one of the schema's non-string types, if it reads as one."""
    s = raw.strip()
    try:
        v = json.loads(s)
    except ValueError:
        v = None
        if "boolean" in types and s.lower() in ("true", "false"):
            return True, s.lower() == "true"
        if "null" in types and s.lower() in ("null", "none"):
            return True, None
        return False, None
    if _fits(v, types):
        if _json_type(v) == "number" and "integer" in types and "number" not in types:
            v = int(v)
        return True, v
    return False, None


def _coerce(raw: str, is_string: bool, schema: Any) -> Any:
    types = _schema_types(schema)
    if is_string:
        if types and "string" not in types:
            ok, v = _coerce_text(raw, types)
            if ok:
                return v
        return raw
    # string="false": the value is JSON text.
    if types == {"string"}:
        return raw  # the schema says string: keep the model's literal text
    try:
        v = json.loads(raw)
    except ValueError:
        if types:
            ok, v2 = _coerce_text(raw, types)
            if ok:
                return v2
        return raw
    if types and not _fits(v, types) and isinstance(v, str):
        ok, v2 = _coerce_text(v, types)  # e.g. "5" for an integer
        if ok:
            return v2
    if types and not _fits(v, types) and "string" in types:
        return raw
    return v


def _build_arguments(params: list[tuple[str, str, bool]], parameters_schema: Any) -> dict:
    props = parameters_schema.get("properties") if isinstance(parameters_schema, dict) else None
    props = props if isinstance(props, dict) else {}
    # A lone "arguments"/"input" wrapper that the schema does not know: unwrap it if it holds a fitting object.
    if len(params) == 1 and params[0][0] in ("arguments", "input") and params[0][0] not in props:
        _, raw, _ = params[0]
        try:
            inner = json.loads(raw)
        except ValueError:
            inner = None
        if isinstance(inner, dict) and (not props or set(inner) <= set(props)):
            out = {}
            for k, v in inner.items():
                types = _schema_types(props.get(k))
                if isinstance(v, str) and types and "string" not in types:
                    ok, v2 = _coerce_text(v, types)
                    v = v2 if ok else v
                out[k] = v
            return out
    args: dict[str, Any] = {}
    for name, raw, is_string in params:
        args[name] = _coerce(raw, is_string, props.get(name))
    return args


# --------------------------------------------------------------------------------------------------------------
# the parser


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


class OutputParser:
    """Feed generated text with `feed`; call `finish` once at the end. See the module docstring."""

    def __init__(
        self,
        thinking: bool,
        tools: list[dict] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
    ) -> None:
        self.tools_enabled = tool_choice != "none"
        self.parallel_tool_calls = parallel_tool_calls
        self._schemas: dict[str, Any] = {}
        for tool in tools or []:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self._schemas[fn["name"]] = fn.get("parameters")
        self._state = _REASONING if thinking else _CONTENT
        self._buf = ""
        self._out: list[Delta] = []
        self._n_calls = 0  # calls announced (emitted)
        self._n_complete = 0
        self._n_parsed = 0  # invokes seen, emitted or not (parallel_tool_calls=False)
        self._invoke: dict | None = None
        self._value_scan = 0  # how far the pending parameter value has been searched for its end
        self._clean_after_block = False  # a tool block closed and only whitespace followed
        self._finished = False

    # -- public API ----------------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish")
        if text:
            self._buf += text
            self._run(final=False)
        return self._take()

    def finish(self, reason: str = "stop") -> tuple[list[Delta], str]:
        if reason not in ("stop", "length"):
            raise ValueError(f"finish reason must be 'stop' or 'length', got {reason!r}")
        if self._finished:
            raise RuntimeError("OutputParser.finish called twice")
        self._finished = True
        self._run(final=True)
        if self._state in (_TOOLS, _INVOKE):
            cut = True  # an unfinished tool block: its partial invoke (if any) is dropped
        elif self._state == _DONE:
            cut = False
        else:
            cut = not self._clean_after_block
        self._invoke = None
        self._buf = ""
        self._state = _DONE
        if reason == "length" and cut:
            finish_reason = "length"
        elif self._n_complete:
            finish_reason = "tool_calls"
        else:
            finish_reason = "stop"
        return self._take(), finish_reason

    # -- internals -----------------------------------------------------------------------------------------------

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit_text(self, kind: str, text: str) -> None:
        if not text:
            return
        if kind == _CONTENT and self._clean_after_block and text.strip():
            self._clean_after_block = False
        if self._out and self._out[-1].kind == kind:
            self._out[-1] = Delta(kind, self._out[-1].text + text)  # type: ignore[arg-type]
        else:
            self._out.append(Delta(kind, text))  # type: ignore[arg-type]

    def _run(self, final: bool) -> None:
        while True:
            st = self._state
            if st in (_REASONING, _CONTENT):
                progressed = self._step_text(final)
            elif st == _TOOLS:
                progressed = self._step_tools(final)
            elif st == _INVOKE:
                progressed = self._step_invoke(final)
            else:
                self._buf = ""
                return
            if not progressed:
                return

    def _text_markers(self) -> tuple[str, ...]:
        m = (THINK_END, THINK_START, EOS)
        return m + (_DSML_OPEN, _DSML_CLOSE, DSML) if self.tools_enabled else m

    def _step_text(self, final: bool) -> bool:
        kind = self._state
        buf = self._buf
        markers = self._text_markers()
        pos, marker = -1, ""
        for m in markers:
            p = buf.find(m)
            if p != -1 and (pos == -1 or p < pos):
                pos, marker = p, m
        if pos != -1 and marker in (_DSML_OPEN, _DSML_CLOSE):
            return self._dsml_tag_in_text(kind, buf, pos, marker, final)
        if pos != -1:
            self._emit_text(kind, buf[:pos])
            self._buf = buf[pos + len(marker):]
            if marker == EOS:
                self._state = _DONE
            elif marker == THINK_END and kind == _REASONING:
                self._state = _CONTENT
            # else: a stray <think> / </think> / bare DSML marker: dropped
            return True
        # No complete marker: hold back a possible marker start (and newlines before a possible tool block).
        hold = _partial_suffix(buf, markers)
        cut = len(buf) - hold
        if self.tools_enabled:
            while cut > 0 and buf[cut - 1] == "\n":
                cut -= 1
        if final:
            tail = buf[len(buf) - hold:]
            if hold and tail.startswith("<\uff5c"):
                # A cut-off special token (e.g. the start of a tool block): never shown, nor its separator.
                self._emit_text(kind, buf[:cut])
            elif self._clean_after_block and not buf.strip():
                pass  # whitespace after a closed tool block (before EOS) is not content
            else:
                self._emit_text(kind, buf)
            self._buf = ""
            return False
        self._emit_text(kind, buf[:cut])
        self._buf = buf[cut:]
        return False

    def _dsml_tag_in_text(self, kind: str, buf: str, pos: int, marker: str, final: bool) -> bool:
        """A DSML tag in reasoning/content: a tool block (or a bare invoke) starts the tools; others are dropped."""
        pre, rest = buf[:pos], buf[pos:]
        gt = rest.find(">")
        lt = rest.find("<", 1)
        if lt != -1 and (gt == -1 or lt < gt) or (gt == -1 and len(rest) >= _MAX_TAG):
            # not a tag after all: drop the marker itself, keep the rest as text
            self._emit_text(kind, pre)
            self._buf = rest[len(marker):]
            return True
        if gt == -1 and final:  # a tag cut off by the end of output: dropped, with its separator
            self._emit_text(kind, pre.rstrip("\n"))
            self._buf = ""
            return False
        if gt == -1:  # the tag is still arriving
            keep = len(pre.rstrip("\n"))
            self._emit_text(kind, pre[:keep])
            self._buf = buf[keep:]
            return False
        tag = rest[: gt + 1]
        if tag == TOOL_CALLS_START or _INVOKE_HEADER.match(tag):
            self._emit_text(kind, pre.rstrip("\n"))
            self._buf = rest[len(tag):] if tag == TOOL_CALLS_START else rest  # a bare invoke is parsed in TOOLS
            self._state = _TOOLS
            return True
        self._emit_text(kind, pre)  # any other DSML tag outside a tool block: dropped
        self._buf = rest[len(tag):]
        return True

    def _skip_garbage(self, s: str) -> str:
        nxt = s.find("<", 1)
        return s[nxt:] if nxt != -1 else ""

    def _step_tools(self, final: bool) -> bool:
        s = self._buf.lstrip()
        self._buf = s
        if not s:
            return False
        if s.startswith(TOOL_CALLS_END):
            self._buf = s[len(TOOL_CALLS_END):]
            self._state = _CONTENT
            self._clean_after_block = True
            return True
        if s.startswith(EOS):
            self._state = _DONE
            return True
        if s.startswith(_INVOKE_OPEN):
            m = _INVOKE_HEADER.match(s)
            if m:
                self._start_invoke(m.group(1))
                self._buf = s[m.end():]
                self._state = _INVOKE
                return True
            if ">" not in s:
                return False  # header still arriving
            self._buf = self._skip_garbage(s)
            return True
        if any(t.startswith(s) for t in (TOOL_CALLS_END, _INVOKE_OPEN, EOS)):
            return False
        self._buf = self._skip_garbage(s)  # unexpected text inside a tool block: not shown
        return True

    def _step_invoke(self, final: bool) -> bool:
        s = self._buf.lstrip()
        self._buf = s
        if not s:
            return False
        if s.startswith(_INVOKE_END):
            self._close_invoke()
            self._buf = s[len(_INVOKE_END):]
            self._state = _TOOLS
            return True
        if s.startswith(TOOL_CALLS_END):  # lenient: a block closed without closing its invoke
            self._close_invoke()
            self._state = _TOOLS
            return True
        if s.startswith(EOS):
            self._state = _DONE
            return True
        if s.startswith(_PARAM_OPEN):
            m = _PARAM_HEADER.match(s)
            if not m:
                if ">" not in s:
                    return False
                self._buf = self._skip_garbage(s)
                return True
            # Resume the value scan where the last feed stopped (the buffer does not move while we wait).
            start = max(m.end(), self._value_scan - max(len(_PARAM_END), len(EOS)))
            close = s.find(_PARAM_END, start)
            eos = s.find(EOS, start)
            if eos != -1 and (close == -1 or eos < close):  # the model ended inside a value: invoke incomplete
                self._state = _DONE
                return True
            if close == -1:
                self._value_scan = len(s)
                return False  # value still arriving
            self._value_scan = 0
            value = s[m.end():close]
            name, string = m.group(1), m.group(2)
            assert self._invoke is not None
            params = self._invoke["params"]
            params[:] = [p for p in params if p[0] != name]  # a repeated name: the last one wins
            params.append((name, value, string != "false"))
            self._buf = s[close + len(_PARAM_END):]
            return True
        if any(t.startswith(s) for t in (_INVOKE_END, TOOL_CALLS_END, _PARAM_OPEN, EOS)):
            return False
        self._buf = self._skip_garbage(s)
        return True

    def _start_invoke(self, name: str) -> None:
        emit = self.parallel_tool_calls or self._n_parsed == 0
        self._n_parsed += 1
        inv = {"name": name, "params": [], "emit": emit, "index": None, "id": None}
        if emit:
            inv["index"] = self._n_calls
            inv["id"] = new_call_id()
            self._n_calls += 1
            self._out.append(Delta("tool_call", index=inv["index"], id=inv["id"], name=name, arguments=""))
        self._invoke = inv

    def _close_invoke(self) -> None:
        inv = self._invoke
        self._invoke = None
        if inv is None or not inv["emit"]:
            return
        args = _build_arguments(inv["params"], self._schemas.get(inv["name"]))
        self._n_complete += 1
        self._out.append(Delta("tool_call", index=inv["index"], arguments=json.dumps(args, ensure_ascii=False)))


# --------------------------------------------------------------------------------------------------------------
# non-streaming


def assemble(deltas: list[Delta]) -> tuple[str | None, str | None, list[dict]]:
    """Combine deltas into (reasoning, content, tool_calls); calls without arguments (cut off) are left out."""
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    calls: dict[int, dict] = {}
    done: set[int] = set()
    for d in deltas:
        if d.kind != "tool_call":
            continue
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        elif d.index in calls:
            calls[d.index]["function"]["arguments"] += d.arguments or ""
            done.add(d.index)
    tool_calls = [calls[i] for i in sorted(calls) if i in done]
    return reasoning or None, content or None, tool_calls


def parse_completion(
    text: str,
    thinking: bool,
    tools: list[dict] | None = None,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
    finish_reason: str = "stop",
) -> tuple[str | None, str | None, list[dict], str]:
    """Parse a whole completion: (reasoning or None, content or None, tool_calls, finish_reason)."""
    p = OutputParser(thinking, tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
    deltas = p.feed(text)
    tail, reason = p.finish(finish_reason)
    reasoning, content, calls = assemble(deltas + tail)
    return reasoning, content, calls, reason
