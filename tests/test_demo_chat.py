"""Issue G's end-to-end path on the shipped model: `moebox serve` with no model serves the trained demo, and the
official openai client gets reasoning apart from the answer, a parsed tool call whose arguments fit the schema,
and an answer that uses the tool's result; the answers are checked for content too (the sum, the city copied
from the question, the temperature and condition from the result). Greedy decoding, so each reply is the model's
single most likely one: a retrained demo that gets one of these wrong fails here."""

from __future__ import annotations

import json

import openai
import pytest

GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
    }, "required": ["city", "unit"]},
}}


@pytest.fixture(scope="module")
def client(demo_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model="moebox-demo", messages=messages, temperature=0.0, max_tokens=200,
                                          **kw).choices[0]


def test_a_question_gets_reasoning_then_an_answer(client):
    choice = _ask(client, [{"role": "user", "content": "What is 27 + 48?"}])
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    reasoning, content = choice.message.reasoning_content, choice.message.content
    assert reasoning and "27" in reasoning and "75" in content
    assert not any(tag in reasoning + content for tag in ("<think>", "</think>", "｜DSML｜", "<｜"))


def test_a_tool_call_then_an_answer_from_its_result(client):
    messages = [{"role": "user", "content": "How warm is it in Vienna, in fahrenheit?"}]
    choice = _ask(client, messages, tools=[GET_WEATHER])
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    assert args == {"city": "Vienna", "unit": "fahrenheit"}

    result = {"city": "Vienna", "temperature": 64, "unit": "fahrenheit", "condition": "rainy", "humidity": 81}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    answer = _ask(client, messages, tools=[GET_WEATHER])
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "64" in answer.message.content and "rainy" in answer.message.content
