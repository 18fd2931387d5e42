"""The OpenAI chat completions wire format: request checking, the prompt the release's chat
template renders, responses and streamed chunks.

The messages are rendered by the release's own chat template (the checkpoint's
``chat_template``, carried into the release with its tokenizer) exactly as Hugging Face's
``apply_chat_template(messages, add_generation_prompt=True)`` renders and tokenizes them, so
an answer here equals the checkpoint's greedy ``generate`` on that prompt.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from pipeline.server.protocol import ApiError, CommonFields, Wire, check_fields

ROLES = ("system", "developer", "user", "assistant")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # What a client sends back when it appends an earlier answer's message object as it
    # came (the openai SDK's ChatCompletionMessage has them): accepted while empty.
    refusal: str | None = None
    annotations: list[Any] | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None


class ChatRequest(CommonFields):
    # The OpenAI fields this server cannot honour are refused by name in parse_chat.
    messages: list[Message]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


def parse_chat(body: Any) -> ChatRequest:
    req = check_fields(ChatRequest, body)
    if not req.messages:
        raise ApiError(400, "'messages' is empty: send at least one message", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            why = "tool messages need tool calling, which" if m.role == "tool" else "it"
            raise ApiError(
                400,
                f"messages[{i}].role '{m.role}' is not supported ({why} this server does not "
                f"serve); use one of {', '.join(ROLES)}",
                param=f"messages.{i}.role",
            )
        for field in ("tool_calls", "function_call", "audio"):
            if getattr(m, field):
                raise ApiError(
                    400,
                    f"messages[{i}].{field} is not supported by this server (no tool calling "
                    "or audio)",
                    param=f"messages.{i}.{field}",
                )
        if m.content is None:
            raise ApiError(400, f"messages[{i}] has no content", param=f"messages.{i}.content")
    if req.logprobs or req.top_logprobs is not None:
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    if req.tools or req.tool_choice not in (None, "none"):
        raise ApiError(400, "tool calling is not supported by this server", param="tools")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise ApiError(
            400,
            "response_format: only {'type': 'text'} is supported (no JSON mode or schemas)",
            param="response_format",
        )
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens differ: send one of them",
            param="max_completion_tokens",
        )
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is not None and limit < 1:
        raise ApiError(400, f"max_completion_tokens must be ≥ 1, got {limit}", param="max_tokens")
    req.max_tokens = limit  # None: as many as the largest bucket holds (admission decides)
    return req


def conversation(req: ChatRequest) -> list[dict[str, str]]:
    """The messages as chat templates take them: text content; ``developer`` (OpenAI's newer
    name for the system role) as ``system``, which is what templates know."""
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's ids: the chat template rendered with the generation prompt, tokenized
    without adding special tokens again (the template writes them), as
    ``apply_chat_template(..., tokenize=True)`` does."""
    if tokenizer is None:
        raise ApiError(400, "this release has no tokenizer, so no chat: use /v1/completions")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this release has no chat template (its checkpoint's tokenizer has none): use "
            "/v1/completions, or release a checkpoint whose tokenizer has a chat_template",
            param="messages",
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (e.g. roles must alternate)
        raise ApiError(
            400, f"the chat template refused the messages: {e}", param="messages"
        ) from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class ChatWire(Wire):
    """Responses and streamed chunks of one chat completion."""

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _delta(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._envelope("chat.completion.chunk", [choice])

    def first(self) -> dict[str, Any] | None:
        return self._delta({"role": "assistant", "content": ""}, None)

    def sends(self, text: str, ids: list[int]) -> bool:
        return bool(text)  # a chat chunk carries no ids

    def _chunk(self, text: Any, ids: Any) -> dict[str, Any]:
        return self._delta({"content": text}, None)

    def last(self, reason: str) -> dict[str, Any]:
        return self._delta({}, reason)

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage}

    def whole(self, text: str, ids: list[int], reason: str, usage: dict[str, int]) -> dict:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        return {**self._envelope("chat.completion", [choice]), "usage": usage}
