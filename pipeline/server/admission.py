"""Admission: a request body (completions or chat) → a checked, tokenized
``jobs.Request`` in the engine's queue, or the ``ApiError`` that answers it (400, 404,
503)."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.runtime.sampling import SamplingParams
from pipeline.server import chat, protocol
from pipeline.server.jobs import Closed, QueueFull
from pipeline.server.jobs import Request as Job
from pipeline.server.protocol import ApiError

RETRY_AFTER_S = 1  # what a 503 asks clients to wait
# A prompt longer than this many characters per position of the largest bucket cannot fit
# (natural text averages 3-5 characters a token): refused before the tokenizer spends on it.
MAX_CHARS_PER_POSITION = 64


async def admit(service: Any, body: Any) -> tuple[Job, protocol.CompletionRequest, int]:
    """Check a completion request and queue it, or raise the ApiError that answers it."""
    _ready(service)
    try:
        req = protocol.parse_request(body)
        _served(service, req.model)
        prompt = await token_ids(service, protocol.one_prompt(req), req)
        sampling = _sampling(service, req)
    except ApiError:
        service.metrics.requests.labels("invalid").inc()
        raise
    assert req.max_tokens is not None
    return _queue(service, prompt, req.max_tokens, sampling), req, len(prompt)


async def admit_chat(service: Any, body: Any) -> tuple[Job, chat.ChatRequest, int]:
    """Check a chat request, render its messages with the release's chat template and queue
    it, or raise the ApiError that answers it."""
    _ready(service)
    try:
        req = chat.parse_chat(body)
        _served(service, req.model)
        messages = chat.conversation(req)
        _fits(service, sum(len(m["content"]) for m in messages), "messages")
        ids = await asyncio.to_thread(chat.render, service.tokenizer, messages)
        prompt = await token_ids(service, ids, req)
        sampling = _sampling(service, req)
    except ApiError:
        service.metrics.requests.labels("invalid").inc()
        raise
    if req.max_tokens is None:  # serve's default, at most what the largest bucket holds
        most = max(1, room(service, len(prompt)))
        default = getattr(service.options, "chat_max_tokens", None)
        req.max_tokens = min(default, most) if default else most
    return _queue(service, prompt, req.max_tokens, sampling), req, len(prompt)


def _sampling(service: Any, req: Any) -> SamplingParams:
    """The request's sampling, or the 400 for what this release's slots cannot honour."""
    params = protocol.sampling_of(req)
    if params.greedy:
        return params
    if req.seed is not None and not getattr(service, "seeded", True):
        raise ApiError(
            400,
            "seed cannot be honoured by this release: its exports sample on the Neuron device, "
            "which has no per-request generator; leave seed out",
            param="seed",
        )
    limit = getattr(service, "max_topk", 0)
    if limit and params.top_k > limit:
        raise ApiError(
            400,
            f"top_k {params.top_k} is above {limit}, the most this release's on-device "
            "sampler takes (its export's max_topk)",
            param="top_k",
        )
    return params


def room(service: Any, prompt: int) -> int:
    """The most tokens an answer to a prompt of this length can have in the largest bucket."""
    seq = service.engine.largest.seq
    return seq - service.release.tokens_needed(prompt, 1) + 1


def _ready(service: Any) -> None:
    if not service.ready or service.engine is None:
        service.metrics.requests.labels("not_ready").inc()
        raise unavailable(f"not ready: {service.phase}", "not_ready")


def _served(service: Any, model: str) -> None:
    if model != service.name:
        raise ApiError(
            404,
            f"model '{model}' is not served here; this server serves '{service.name}'",
            param="model",
            code="model_not_found",
        )


def _queue(service: Any, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Job:
    m = service.metrics
    engine = service.engine
    need = service.release.tokens_needed(len(prompt), max_tokens)
    largest = engine.largest
    if need > largest.seq:
        m.requests.labels("too_long").inc()
        raise ApiError(
            400,
            f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} needs {need} "
            f"positions; the largest bucket, {largest.name}, holds {largest.seq}: shorten the "
            "prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    job = Job(prompt=prompt, max_tokens=max_tokens, need=need, sampling=sampling)
    try:
        engine.submit(job)
    except QueueFull:
        m.requests.labels("queue_full").inc()
        message = f"the queue is full ({engine.max_queue} waiting): retry later"
        raise unavailable(message, "queue_full") from None
    except Closed:
        m.requests.labels("not_ready").inc()
        raise unavailable("shutting down") from None
    return job


def _fits(service: Any, chars: int, param: str) -> None:
    """Refuse text that cannot fit the largest bucket before the tokenizer spends on it."""
    longest = service.engine.largest.seq
    if chars > longest * MAX_CHARS_PER_POSITION:
        raise ApiError(
            400,
            f"{param} of {chars} characters cannot fit the largest bucket ({longest} "
            f"positions): shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )


def unavailable(message: str, code: str | None = None) -> ApiError:
    """503 with Retry-After: come back in a moment."""
    return ApiError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


async def token_ids(service: Any, prompt: str | list[int], req: Any) -> list[int]:
    """The prompt's token ids (text through the release's tokenizer), checked against the
    model's vocabulary."""
    if isinstance(prompt, str):
        if service.tokenizer is None:
            raise ApiError(
                400,
                "this release has no tokenizer: send the prompt as a list of token ids",
                param="prompt",
            )
        _fits(service, len(prompt), "prompt")
        # Off the event loop: a long prompt must not stall /health and the other requests.
        ids = list((await asyncio.to_thread(service.tokenizer, prompt)).input_ids)
    else:
        ids = list(prompt)
    # The tokenizer's ids too: one with added tokens beyond the model's embedding would
    # otherwise index past it on the device.
    bad = [t for t in ids if not 0 <= t < service.vocab]
    if bad:
        source = "the tokenizer gave" if isinstance(prompt, str) else "the prompt has"
        raise ApiError(
            400,
            f"{source} token ids {bad[:5]} outside the model's vocabulary (0..{service.vocab - 1})",
            param="prompt",
        )
    if protocol.stop_list(req) and service.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this release has none", param="stop")
    return ids
