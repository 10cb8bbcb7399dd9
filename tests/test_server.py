"""The OpenAI surface of a real `moebox serve` process, driven by the official `openai` client."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import moebox
from tests.servers import start_server


@pytest.fixture(scope="module")
def client(demo_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0)


HELLO = [{"role": "user", "content": "Hello there"}]
DEMO_MAX_LEN = json.loads((Path(moebox.__file__).parent / "demo_model" / "config.json").read_text())[
    "max_position_embeddings"]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["moebox-demo"]
    assert models[0].max_model_len == DEMO_MAX_LEN           # an extra field clients use
    assert client.models.retrieve("moebox-demo").id == "moebox-demo"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    assert e.value.body["code"] == "model_not_found"


def test_chat_non_stream(client):
    r = client.chat.completions.create(model="moebox-demo", messages=HELLO, max_tokens=12)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # thinking is on by default: the reply so far is reasoning, exposed as reasoning_content, never markup
    text = (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
    assert "</think>" not in text and "｜DSML｜" not in text


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(model="moebox-demo", messages=HELLO, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens == 10 or finishes == ["stop"]


def test_chat_modes_and_n(client):
    r = client.chat.completions.create(model="moebox-demo", messages=HELLO, max_tokens=6, n=2, temperature=1.0,
                                       seed=3, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(getattr(c.message, "reasoning_content", None) is None for c in r.choices)   # chat mode: no reasoning
    assert r.choices[0].message.content != r.choices[1].message.content    # choices get their own seeds
    one = client.chat.completions.create(model="moebox-demo", messages=HELLO, max_tokens=6, n=1,
                                         extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.prompt_tokens == one.usage.prompt_tokens                 # the prompt counts once for n=2


def test_completions(client):
    r = client.completions.create(model="moebox-demo", prompt="Once upon a time", max_tokens=8, temperature=0,
                                  logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason in ("stop", "length")
    assert len(c.logprobs.tokens) == r.usage.completion_tokens and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    again = client.completions.create(model="moebox-demo", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert again.choices[0].text == c.text                      # greedy is deterministic
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="moebox-demo", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert streamed == c.text


def test_context_length_exceeded_has_the_wording_agents_grep_for(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="moebox-demo", messages=[{"role": "user", "content": "x " * DEMO_MAX_LEN}],
                                       max_tokens=10)
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {DEMO_MAX_LEN} tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="moebox-demo", messages=HELLO, max_tokens=DEMO_MAX_LEN + 1)
    assert e.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body,fragment", [
    ({"model": "moebox-demo", "messages": []}, "messages"),
    ({"model": "moebox-demo", "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"model": "moebox-demo", "messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"model": "moebox-demo", "messages": HELLO, "tools": [{"type": "function", "function": {"nam": "x"}}]},
     "tools"),
    ({"model": "moebox-demo", "messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
    ({"model": "moebox-demo", "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_invalid_requests_get_openai_400s(demo_server, body, fragment):
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in (err["message"] + str(err["param"]))


def test_malformed_json_and_unknown_model(demo_server):
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", json={"model": "nope", "messages": HELLO})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(model="moebox-demo", messages=HELLO, max_tokens=3,
                                       extra_body={"some_vendor_flag": {"x": 1}, "top_k": 5, "min_p": 0.1})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_health_and_metrics(demo_server):
    assert httpx.get(demo_server.base_url + "/health").json() == {"status": "ok"}
    text = httpx.get(demo_server.base_url + "/metrics").text
    for name in ("moebox_requests_total", "moebox_generation_tokens_total", "moebox_time_to_first_token_seconds",
                 "moebox_inter_token_latency_seconds", "moebox_requests_waiting", "moebox_cache_usage"):
        assert name in text


def test_api_key(tiny_ckpt, tmp_path):
    server = start_server([str(tiny_ckpt), "--api-key", "s3cret"], tmp_path / "cache", tmp_path / "log")
    try:
        url = server.base_url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).models.list().data[0].id == "tiny0"
        assert httpx.get(server.base_url + "/health").status_code == 200       # health needs no key
    finally:
        server.stop()


def test_health_is_503_while_loading():
    """The app with no model loaded yet (the state `moebox serve` is in while it loads)."""
    import asyncio

    from moebox.server.app import ServerState, create_app

    async def go():
        state = ServerState("m", progress="loading weights 40/357")
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            h = await c.get("/health")
            chat = await c.post("/v1/chat/completions", json={"messages": HELLO})
        return h, chat
    h, chat = asyncio.run(go())
    assert h.status_code == 503 and h.json() == {"status": "loading", "progress": "loading weights 40/357"}
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "model_loading"


def test_impossible_plan_stops_serve_in_seconds(tiny_ckpt, tmp_path):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "moebox.cli", "serve", str(tiny_ckpt), "--memory", "1MiB", "--port",
                        "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.time() - t0 < 60
    errors = [line for line in r.stderr.splitlines() if line.startswith("moebox: error:")]
    assert len(errors) == 1 and "memory" in errors[0] and "Traceback" not in r.stderr


def test_completions_with_several_prompts(client):
    prompts = ["Once upon a time", "The quick brown fox"]
    r = client.completions.create(model="moebox-demo", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):       # greedy: each prompt's choices equal a request of its own
        alone = client.completions.create(model="moebox-demo", prompt=prompt, max_tokens=6, temperature=0)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text
    assert r.usage.prompt_tokens == sum(client.completions.create(model="moebox-demo", prompt=p, max_tokens=1)
                                        .usage.prompt_tokens for p in prompts)
