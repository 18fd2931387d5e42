"""The OpenAI completions wire format: request checking, sampling, responses, errors.

Only what the runtime can honour is accepted: greedy decoding (temperature 0, or left out)
or sampling with ``temperature``, ``top_p``, ``top_k`` and ``seed``; one prompt, one
choice. Any parameter that would change the answer and cannot be honoured is a 400 that
says so, never silently ignored.
"""

from __future__ import annotations

import functools
import json
import math
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, ValidationError

from pipeline.runtime.sampling import GREEDY, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error"}.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class CommonFields(BaseModel):
    """The fields both completion routes share: the model, sampling, stop and streaming.
    Unknown parameters are refused: a sampler option silently ignored changes answers."""

    model_config = ConfigDict(extra="forbid")

    # Strict ints and bools: JSON true is not 1, and "16" is not a number (lax pydantic
    # would take both, and a prompt of [true] would run as token 1).
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None  # vLLM's extension: 0 or -1 keep every token
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None  # the same seed, prompt and release: the same tokens
    model: str
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None


class CompletionRequest(CommonFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = DEFAULT_MAX_TOKENS
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: str | None = None


# parameter -> (the value that means "off", why it cannot be honoured)
_GREEDY_ONLY = {
    "n": (1, "one choice per request (each choice would hold a slot of its own: send n requests)"),
    "best_of": (1, "one choice per request"),
    "presence_penalty": (0.0, "no penalties: the sampler reads the step's logits as they are"),
    "frequency_penalty": (0.0, "no penalties: the sampler reads the step's logits as they are"),
}


M = TypeVar("M", bound=CommonFields)


def check_fields(cls: type[M], body: Any) -> M:
    """The request as ``cls``, with the checks both routes share; else the 400 naming the
    field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            msg = f"unsupported parameter '{param}': this server cannot honour it"
        else:
            msg = f"invalid '{param}': {err['msg']}"
        raise ApiError(400, msg, param=param) from None
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):  # JSON's NaN and Infinity parse
            raise ApiError(400, f"{name} must be a finite number, got {value}", param=name)
    if req.temperature is not None and req.temperature < 0:
        raise ApiError(400, "temperature must be ≥ 0", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(400, f"top_k must be ≥ 1 (or 0 or -1: all), got {req.top_k}", param="top_k")
    for name, (off, why) in _GREEDY_ONLY.items():
        value = getattr(req, name, None)
        if value is not None and value != off:
            raise ApiError(400, f"{name}={value} is not supported: {why}; send {off}", param=name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
    stops = getattr(req, "stop", None)
    if stops is not None and not isinstance(stops, str) and len(stops) > 4:
        raise ApiError(400, "at most 4 stop sequences", param="stop")
    return req


def parse_request(body: Any) -> CompletionRequest:
    req = check_fields(CompletionRequest, body)
    if req.logprobs is not None:
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    if req.echo:
        raise ApiError(400, "echo is not supported by this server", param="echo")
    if req.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
    if req.max_tokens is None:
        req.max_tokens = DEFAULT_MAX_TOKENS
    if req.max_tokens < 1:
        raise ApiError(400, f"max_tokens must be ≥ 1, got {req.max_tokens}", param="max_tokens")
    return req


def sampling_of(req: CommonFields) -> SamplingParams:
    """The request's sampling: greedy when ``temperature`` is 0 or left out (this server's
    default; OpenAI's is 1), else drawn with its seed, or a fresh random one."""
    temperature = req.temperature or 0.0
    if temperature == 0:
        return GREEDY
    seed = req.seed if req.seed is not None else secrets.randbits(62)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    top_p = req.top_p if req.top_p is not None else 1.0
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def stop_list(req: Any) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def one_prompt(req: CompletionRequest) -> str | list[int]:
    """The request's single prompt (text or token ids)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(
                400, f"{len(p)} prompts in one request: send one per request", param="prompt"
            )
        p = p[0]
    if not p:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return p


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion(
    rid: str,
    model: str,
    created: int,
    text: str,
    token_ids: list[int] | None,
    finish_reason: str | None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A completion (or one streamed chunk of it). ``token_ids`` is an extension field: the
    generated ids (the client's models keep unknown fields)."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
            }
        ],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def sse(data: dict[str, Any]) -> str:
    """``data`` as one server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


# json.dumps(text) of a str, without dumps' own checks: what dumps calls for one
_json_str = json.encoder.encode_basestring_ascii
# stand-ins for a chunk's text and ids: JSON escapes the NULs, so no dumped text is one
_TEXT, _IDS = "\0text\0", "\0ids\0"


class ChunkEvents:
    """``sse(chunk(text, ids))`` for one stream's chunks, which differ only in their text
    and ids: the rest is dumped once, from ``chunk`` itself (so the wire's dict stays the
    one format), and each chunk fills in its text's JSON and its ids (if ``chunk`` sends
    them)."""

    def __init__(self, chunk: Callable[[Any, Any], dict[str, Any]]) -> None:
        # the text comes after the id and model, which could hold a stand-in: the last one
        self.head, text, rest = sse(chunk(_TEXT, _IDS)).rpartition(_json_str(_TEXT))
        mid, ids, tail = rest.partition(_json_str(_IDS))
        assert text, "the chunk holds no text"
        self.mid: str | None = mid if ids else None
        self.tail = tail if ids else mid

    def fill(self, text: str, ids: list[int]) -> str:
        if self.mid is None:
            return f"{self.head}{_json_str(text)}{self.tail}"
        # an int's str is its JSON
        return f"{self.head}{_json_str(text)}{self.mid}[{', '.join(map(str, ids))}]{self.tail}"


class Wire:
    """One answer's responses and streamed chunks; a route's format says which chunks go
    out (``sends``) and what they hold (``_chunk``), and both ``chunk`` and its event
    follow from those."""

    def __init__(self, rid: str, model: str, created: int) -> None:
        self.rid, self.model, self.created = rid, model, created

    def sends(self, text: str, ids: list[int]) -> bool:
        raise NotImplementedError

    def _chunk(self, text: Any, ids: Any) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, text: str, ids: list[int]) -> dict[str, Any] | None:
        return self._chunk(text, ids) if self.sends(text, ids) else None

    def chunk_event(self, text: str, ids: list[int]) -> str | None:
        """``sse(self.chunk(text, ids))``, from this stream's template."""
        return self._events.fill(text, ids) if self.sends(text, ids) else None

    @functools.cached_property
    def _events(self) -> ChunkEvents:
        return ChunkEvents(self._chunk)


class CompletionWire(Wire):
    """Responses and streamed chunks of one text completion (see ``chat.ChatWire``)."""

    def first(self) -> dict[str, Any] | None:
        return None

    def sends(self, text: str, ids: list[int]) -> bool:
        return bool(text or ids)

    def _chunk(self, text: Any, ids: Any) -> dict[str, Any]:
        return completion(self.rid, self.model, self.created, text, ids, None)

    def last(self, reason: str) -> dict[str, Any]:
        return completion(self.rid, self.model, self.created, "", [], reason)

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        chunk = completion(self.rid, self.model, self.created, "", [], None)
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    def whole(self, text: str, ids: list[int], reason: str, usage: dict[str, int]) -> dict:
        return completion(self.rid, self.model, self.created, text, ids, reason, usage)


def usage(prompt: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def now() -> int:
    return int(time.time())
