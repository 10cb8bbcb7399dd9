"""OpenAI request bodies (pydantic) and the OpenAI error object.

Unknown fields are ignored, never rejected: agents send many vendor extras. Types that are wrong are a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None     # checked against ToolDef, kept as sent (see _check_tools)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | bool | None = None

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Validated as ToolDef, but returned as sent: the prompt renders tools with the client's key order
        (DeepSeek's encoder dumps them as received), which a pydantic round trip would reorder."""
        for tool in tools or []:
            ToolDef.model_validate(tool)
        return tools


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
