"""The OpenAI request and response shapes both servers speak (the subset exitplan serves), and its error format."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS_LIMIT = 4096
"""Largest ``max_tokens`` accepted (a server may allow less: its context)."""

MAX_SEED = 2**64 - 1
"""Largest ``seed``: what ``torch.Generator.manual_seed`` accepts (beyond it torch raises, which was a 500)."""


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """End the stream with one more chunk, its ``choices`` empty, whose ``usage`` counts the tokens (OpenAI's: a
    client counting events undercounts tokens when a server sends several in one event, as vLLM's does when its
    API server lags behind its engine)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    stream: bool = False
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    user: str | None = None
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str = Field(min_length=1)


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)

    def limit(self) -> int:
        """The generation limit asked for."""
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    """A response id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage block."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(rid: str, model: str, chat: bool, tokens: tuple[int, int]) -> dict[str, Any]:
    """The last chunk of a stream that asked for ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage(*tokens)}


def completion(rid: str, model: str, text: str, finish: str | None, chat: bool,
               tokens: tuple[int, int] | None = None, chunk: bool = False) -> dict[str, Any]:
    """A (chunk of a) completion or chat completion response."""
    if chat:
        choice: dict[str, Any] = ({"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": finish}
                                  if chunk else {"index": 0, "message": {"role": "assistant", "content": text},
                                                 "finish_reason": finish})
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    body: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
                            "choices": [choice]}
    if tokens is not None:
        body["usage"] = usage(*tokens)
    return body
