"""The OpenAI-compatible HTTP server: protocol translation around the engine, nothing more.

Requests are validated (pydantic), rendered with the DeepSeek-V4 chat encoder, tokenized and submitted to the
engine, which runs on its own thread; its token events come back through `call_soon_threadsafe` into one
asyncio queue per HTTP request. The output parser turns text into reasoning / content / tool-call deltas for
both the streaming and the non-streaming path. A client that goes away cancels its engine requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import HTTPConnection

from moebox.errors import MoeboxError
from moebox.runtime.engine import Event, QueueFull
from moebox.runtime.engine import Request as EngineRequest
from moebox.runtime.metrics import EngineMetrics
from moebox.runtime.sampler import SamplingParams
from moebox.server.chat_format import DSML, THINK_END, TOOL_CALLS_START, encode_messages, resolve_thinking
from moebox.server.parsers import Delta, OutputParser, assemble
from moebox.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

log = logging.getLogger("moebox")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


@dataclass
class ServerState:
    """What the app needs; `llm` is None until the model has loaded (then /health turns 200)."""

    model_name: str
    api_key: str | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    llm: Any = None
    progress: str = "starting"
    failed: str | None = None
    defaults: dict[str, float] = field(default_factory=dict)     # generation_config.json sampling defaults
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moebox", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON ({err.get('ctx', {}).get('error', msg)})"
        return JSONResponse(error_body(f"{where}: {msg}" if where else msg, param=where or None), status_code=400)

    class Auth:
        """API-key check as plain ASGI middleware: `@app.middleware("http")` (BaseHTTPMiddleware) wraps `receive`
        so that `Request.is_disconnected()` never sees a client leave, and a non-stream request would then
        generate to the end for nobody."""

        def __init__(self, app) -> None:
            self.app = app

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http" and state.api_key:
                conn = HTTPConnection(scope)
                if conn.url.path.startswith("/v1/") and conn.headers.get("authorization") != f"Bearer {state.api_key}":
                    response = JSONResponse(error_body("Invalid API key: pass it as 'Authorization: Bearer <key>'",
                                                       code="invalid_api_key"), status_code=401)
                    return await response(scope, receive, send)
            await self.app(scope, receive, send)

    app.add_middleware(Auth)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.failed:
            return JSONResponse({"status": "failed", "error": state.failed}, status_code=503)
        if state.llm is None:
            return JSONResponse({"status": "loading", "progress": state.progress}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "moebox",
                "root": state.model_name, "parent": None, "permission": []}
        if state.llm is not None:
            card["max_model_len"] = state.llm.max_model_len
        return card

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    def check_model(name: str | None) -> None:
        if name and name != state.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", code="model_not_found", param="model")

    def ready():
        if state.llm is None:
            raise APIError(503, f"the model is still loading ({state.progress}); retry when /health says ok",
                           type_="service_unavailable_error", code="model_loading")
        return state.llm

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        state.metrics.requests.labels(endpoint="chat").inc()
        check_model(body.model)
        llm = ready()
        tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if tool_choice not in ("none", "auto") and not body.tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs `tools`", param="tool_choice")
        tools = body.tools if body.tools and tool_choice != "none" else None
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if not tools or name not in {t["function"]["name"] for t in tools}:
                raise APIError(400, f"tool_choice names function {name!r}, which is not in `tools`",
                               param="tool_choice")
        try:
            thinking, effort = resolve_thinking(body.chat_template_kwargs, body.thinking, body.reasoning_effort)
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            prompt = encode_messages(messages, tools=tools, thinking=thinking, reasoning_effort=effort,
                                     response_format=body.response_format)
        except MoeboxError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False).ids
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = sampling(state, body, check_context(llm, len(ids), max_tokens), skip_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        run = Generation(state, request, [ids], params, body.n, logprobs, body.presence_penalty,
                         body.frequency_penalty)
        if tools and tool_choice not in ("auto", "none"):
            # required / named: once the answer starts, open the tool-call block (and name the tool)
            opening = f"\n\n{TOOL_CALLS_START}\n<{DSML}invoke name=\""
            if isinstance(tool_choice, dict):
                opening += f'{tool_choice["function"]["name"]}">\n'
            for r in run.requests:
                r.force_after = THINK_END if thinking else ""
                r.forced_ids = llm.tokenizer.encode(opening, add_special_tokens=False).ids
        parsers = [OutputParser(thinking, tools, tool_choice, body.parallel_tool_calls) for _ in range(body.n)]
        run.start()
        chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(run, chat_stream(run, parsers, chat_id, created, state.model_name, include_usage))
        choices = await chat_choices(run, parsers, llm)
        return {"id": chat_id, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": run.usage()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.metrics.requests.labels(endpoint="completions").inc()
        check_model(body.model)
        llm = ready()
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        ids = [llm.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        max_tokens = min(check_context(llm, len(x), body.max_tokens, "prompt") for x in ids)
        params = sampling(state, body, max_tokens, skip_special_tokens=True)
        run = Generation(state, request, ids, params, body.n, body.logprobs, body.presence_penalty,
                         body.frequency_penalty)
        run.start()
        cmpl_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echoes = [(p if isinstance(p, str) else llm.decode(x)) if body.echo else "" for p, x in zip(prompts, ids)]
        echo = [echoes[i // body.n] for i in range(run.n)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(run, completion_stream(run, cmpl_id, created, state.model_name, include_usage, echo))
        texts, finishes, lps = list(echo), [None] * run.n, [[] for _ in range(run.n)]
        async for i, ev in run.events():
            texts[i] += ev.text
            lps[i] += ev.logprobs
            finishes[i] = ev.finish_reason or finishes[i]
        if not all(run.done):
            raise APIError(499, "client closed the request")
        choices = [{"index": i, "text": texts[i], "finish_reason": finishes[i],
                    "logprobs": completion_logprobs(llm, lps[i]) if body.logprobs is not None else None}
                   for i in range(run.n)]
        return {"id": cmpl_id, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": run.usage()}

    return app


# ---------------------------------------------------------------------------------------------- request helpers
def check_context(llm, prompt_tokens: int, max_tokens: int | None, param: str = "messages") -> int:
    """The max_tokens to use, or the OpenAI-worded 400 when the request cannot fit the context."""
    limit = llm.max_model_len
    wanted = max_tokens if max_tokens is not None else max(limit - prompt_tokens, 0)
    if prompt_tokens + wanted > limit or wanted < 1:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{wanted} output tokens and your prompt contains at least {prompt_tokens} input tokens, "
                            f"for a total of at least {prompt_tokens + wanted} tokens. Please reduce the length of "
                            f"the input prompt or the number of requested output tokens.",
                       code="context_length_exceeded", param=param)
    return wanted


def sampling(state: ServerState, body, max_tokens: int, skip_special_tokens: bool) -> SamplingParams:
    d = state.defaults
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else d.get("temperature", 1.0),
            top_p=body.top_p if body.top_p is not None else d.get("top_p", 1.0),
            top_k=body.top_k if body.top_k is not None else int(d.get("top_k", 0)),
            min_p=body.min_p or 0.0, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
            skip_special_tokens=skip_special_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from None


class Generation:
    """The engine requests of one HTTP request (n choices per prompt; choice index = prompt * n + j), their
    events merged into one asyncio queue."""

    def __init__(self, state: ServerState, http: Request, prompts: list[list[int]], params: SamplingParams, n: int,
                 logprobs: int | None, presence: float, frequency: float) -> None:
        self.state, self.http, self.n = state, http, n * len(prompts)
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = [0] * self.n
        self.done = [False] * self.n

        def callback(i: int):
            def on_event(ev: Event) -> None:
                try:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
                except RuntimeError:          # the event loop is gone (server shutting down)
                    pass
            return on_event

        self.requests = []
        for i in range(self.n):
            j = i % n                     # choices of one prompt get seeds seed, seed+1, ...
            p = params if params.seed is None or j == 0 else \
                SamplingParams(**{**vars(params), "seed": (params.seed + j) % 2**64})
            self.requests.append(EngineRequest(f"{base}-{i}", prompts[i // n], p, callback(i), logprobs=logprobs,
                                               presence_penalty=presence, frequency_penalty=frequency))

    def start(self) -> None:
        engine = self.state.llm.engine
        try:
            for r in self.requests:
                engine.submit(r)
        except QueueFull as e:
            self.cancel()
            raise APIError(503, str(e), type_="service_unavailable_error", code="server_busy") from None
        except MoeboxError as e:
            self.cancel()
            raise APIError(400, str(e)) from None
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for r, done in zip(self.requests, self.done):
            if not done:
                self.state.llm.engine.cancel(r.id)

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """Events until every choice finished; cancels the engine requests if the consumer stops early or the
        client disconnects."""
        try:
            next_check = time.monotonic() + 1.0
            while not all(self.done):
                # look for a gone client about once a second, also while events keep coming (a non-stream
                # request sends nothing until it is done, so only this notices its client leaving)
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), timeout=max(next_check - time.monotonic(), 0))
                except asyncio.TimeoutError:
                    i, ev = -1, None
                if time.monotonic() >= next_check:
                    if await self.http.is_disconnected():
                        return
                    next_check = time.monotonic() + 1.0
                if ev is None:
                    continue
                self.completion_tokens[i] = ev.completion_tokens
                if ev.finish_reason:
                    self.done[i] = True
                yield i, ev
        finally:
            self.cancel()

    def usage(self) -> dict[str, Any]:
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def sse(run: Generation, chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except Exception as e:                 # after the headers went out, an error can only be an event
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        finally:
            run.cancel()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


# ---------------------------------------------------------------------------------------------- chat output
def token_logprobs(llm, lps) -> list[dict[str, Any]]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        tok = llm.tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
    return [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps]


def delta_json(d: Delta) -> dict[str, Any]:
    if d.kind == "reasoning":
        return {"reasoning_content": d.text}
    if d.kind == "content":
        return {"content": d.text}
    fn: dict[str, Any] = {"arguments": d.arguments or ""}
    call: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        call.update(id=d.id, type="function")
        fn = {"name": d.name, **fn}
    return {"tool_calls": [{**call, "function": fn}]}


def release_complete_calls(deltas: list[Delta], held: dict[int, Delta]) -> list[Delta]:
    """Hold each tool call's header until its arguments arrive, then send both: a call cut off by max_tokens
    is never announced to the client."""
    out = []
    for d in deltas:
        if d.kind == "tool_call" and d.id is not None:
            held[d.index] = d
        elif d.kind == "tool_call":
            out += [h for h in (held.pop(d.index, None), d) if h is not None]
        else:
            out.append(d)
    return out


async def chat_stream(run: Generation, parsers: list[OutputParser], chat_id: str, created: int, model: str,
                      include_usage: bool) -> AsyncIterator[dict]:
    llm = run.state.llm
    base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}
    held: list[dict[int, Delta]] = [{} for _ in parsers]
    for i in range(run.n):
        yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
    async for i, ev in run.events():
        deltas = parsers[i].feed(ev.text)
        finish = None
        if ev.finish_reason:
            tail, finish = parsers[i].finish("length" if ev.finish_reason == "length" else "stop")
            deltas += tail
            if ev.finish_reason == "error":
                finish = "error"
        deltas = release_complete_calls(deltas, held[i])
        lps = {"content": token_logprobs(llm, ev.logprobs)} if ev.logprobs else None
        for k, d in enumerate(deltas):
            yield {**base, "choices": [{"index": i, "delta": delta_json(d), "logprobs": lps if k == 0 else None,
                                        "finish_reason": None}]}
        if not deltas and lps:
            yield {**base, "choices": [{"index": i, "delta": {}, "logprobs": lps, "finish_reason": None}]}
        if finish:
            yield {**base, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}]}
    if include_usage:
        yield {**base, "choices": [], "usage": run.usage()}


async def chat_choices(run: Generation, parsers: list[OutputParser], llm) -> list[dict[str, Any]]:
    deltas: list[list[Delta]] = [[] for _ in parsers]
    lps: list[list] = [[] for _ in parsers]
    finishes: list[str | None] = [None] * run.n
    async for i, ev in run.events():
        deltas[i] += parsers[i].feed(ev.text)
        lps[i] += ev.logprobs
        if ev.finish_reason:
            tail, finishes[i] = parsers[i].finish("length" if ev.finish_reason == "length" else "stop")
            deltas[i] += tail
            if ev.finish_reason == "error":
                finishes[i] = "error"
    if not all(run.done):
        raise APIError(499, "client closed the request")
    choices = []
    for i, ds in enumerate(deltas):
        reasoning, content, calls = assemble(ds)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                                   "reasoning_content": reasoning}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": i, "message": message, "finish_reason": finishes[i],
                        "logprobs": {"content": token_logprobs(llm, lps[i])} if run.requests[i].logprobs is not None
                        else None})
    return choices


# ---------------------------------------------------------------------------------------------- completions
def completion_logprobs(llm, lps) -> dict[str, Any]:
    toks = [llm.tokenizer.decode([x.token_id], skip_special_tokens=False) for x in lps]
    offsets, pos = [], 0
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": toks, "token_logprobs": [x.logprob for x in lps], "text_offset": offsets,
            "top_logprobs": [{llm.tokenizer.decode([t], skip_special_tokens=False): v for t, v in x.top}
                             for x in lps]}


async def completion_stream(run: Generation, cmpl_id: str, created: int, model: str, include_usage: bool,
                            echo: list[str]) -> AsyncIterator[dict]:
    base = {"id": cmpl_id, "object": "text_completion", "created": created, "model": model}
    for i, text in enumerate(echo):
        if text:
            yield {**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}
    async for i, ev in run.events():
        if ev.text or ev.finish_reason:
            lps = completion_logprobs(run.state.llm, ev.logprobs) if ev.logprobs else None
            yield {**base, "choices": [{"index": i, "text": ev.text, "logprobs": lps,
                                        "finish_reason": ev.finish_reason}]}
    if include_usage:
        yield {**base, "choices": [], "usage": run.usage()}
