"""The HTTP routes (FastAPI): probes, metrics, and the OpenAI routes under ``/v1`` (models,
completions, chat completions; behind the API key when one is set), answered from the
engine's events, streamed or whole.

The server listens at once (``/health`` answers while a large release loads); ``/ready``
and the completion route answer 503 until the release is loaded and warm. A client that
leaves frees its slot at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.server import chat, protocol
from pipeline.server.admission import admit, admit_chat, unavailable
from pipeline.server.auth import check_key
from pipeline.server.jobs import Failed, Finished, Tokens
from pipeline.server.jobs import Request as Job
from pipeline.server.protocol import ApiError
from pipeline.server.service import Service
from pipeline.server.tokenizer import TextStream


def create_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start(asyncio.get_running_loop())
        probe = asyncio.ensure_future(service.metrics.probe_loop())
        try:
            yield
            await service.stop()
        finally:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe

    app = FastAPI(title="inf2-pipeline serve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        phase = service.phase
        if service.ready and not service.all_ready:
            phase = "starting the other HTTP processes"
        body = {"status": phase}
        if service.error:
            body["error"] = service.error
        return JSONResponse(body, status_code=200 if service.all_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, media_type = service.metrics.exposition()
        return Response(body, media_type=media_type)

    async def authorized(authorization: str | None = Header(default=None)) -> None:
        try:
            check_key(service.options.api_key, authorization)
        except ApiError:
            service.metrics.requests.labels("unauthorized").inc()
            raise

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        data = []
        if service.name:
            data.append(
                {"id": service.name, "object": "model", "created": 0, "owned_by": "inf2-pipeline"}
            )
        return {"object": "list", "data": data}

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        received = time.monotonic()
        job, req, prompt_len = await admit(service, await _body(service, request))
        wire = protocol.CompletionWire(protocol.new_id(), service.name, protocol.now())
        return await _answer(service, request, job, req, wire, prompt_len, received)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.monotonic()
        job, req, prompt_len = await admit_chat(service, await _body(service, request))
        wire = chat.ChatWire(chat.new_id(), service.name, protocol.now())
        return await _answer(service, request, job, req, wire, prompt_len, received)

    app.include_router(v1)
    return app


async def _body(service: Service, request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        service.metrics.requests.labels("invalid").inc()
        raise ApiError(400, "the request body is not JSON") from None


async def _answer(
    service: Service,
    request: Request,
    job: Job,
    req: Any,
    wire: Any,
    prompt_len: int,
    received: float,
) -> Response:
    """The queued job's answer in the route's wire format: streamed as server-sent events,
    or whole once it ends (a client that leaves first frees its slot). ``received``: when
    the route began, for the admission's time."""
    text = TextStream(service.tokenizer, protocol.stop_list(req))
    service.metrics.admission.observe(job.arrival - received)
    service.metrics.in_flight.inc()
    service.metrics.prompt_tokens.inc(prompt_len)
    if req.stream:
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        gen = _sse(service, job, text, wire, prompt_len, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(service, job, text))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not collect.done():  # the client left: free its slot
        collect.cancel()
        _gone(service, job)
        return Response(status_code=499)
    reason, out_text, ids = collect.result()
    return JSONResponse(wire.whole(out_text, ids, reason, protocol.usage(prompt_len, len(ids))))


async def _tokens(service: Service, job: Job, text: TextStream) -> AsyncIterator[tuple[str, Any]]:
    """The job's events as ("text", (delta, ids)) and finally ("done", reason); stops early
    (and frees the slot) when a stop string appears.

    Tokens already waiting are sent together (``serve --no-coalesce``: one event each): when
    the event loop falls behind the engine (many streams, one GIL), each client gets one
    event for what piled up instead of one per token, so the loop's work per token falls
    when it must: each event is a socket write and a pass through Starlette's layers, the
    front's main cost under load (bench/RESULTS.md, 2026-12-06)."""
    queue = job.events
    coalesce = service.options.coalesce
    event: Any = None
    while True:
        event = event or await queue.get()
        if isinstance(event, Tokens):
            ids, event = list(event.ids), None
            while coalesce and event is None and not queue.empty():
                waiting = queue.get_nowait()
                if isinstance(waiting, Tokens):
                    ids += waiting.ids
                else:
                    event = waiting  # the end: handled after these tokens
            delta, sent = "", []
            for token in ids:  # one at a time: a stop string ends at its own token
                delta += text.push([token])
                sent.append(token)
                if text.stopped:
                    break
            yield "text", (delta, sent)
            if text.stopped:
                service.engine.cancel(job)  # type: ignore[union-attr]
                yield "done", "stop"
                return
        elif isinstance(event, Finished):
            yield "text", (text.flush(), [])
            yield "done", "stop" if text.stopped else event.reason  # a stop in the held text
            return
        else:
            assert isinstance(event, Failed)
            if event.retry:
                raise unavailable(f"not served: {event.message}", "shutting_down")
            raise ApiError(500, f"generation failed: {event.message}")


async def _collect(service: Service, job: Job, text: TextStream) -> tuple[str, str, list[int]]:
    parts: list[str] = []
    ids: list[int] = []
    try:
        async for kind, value in _tokens(service, job, text):
            if kind == "text":
                parts.append(value[0])
                ids += value[1]
            else:
                _done(service, job, len(ids), "ok")
                return value, "".join(parts), ids
    except ApiError as e:
        _done(service, job, len(ids), "not_ready" if e.status == 503 else "error")
        raise
    raise AssertionError("unreachable")


async def _sse(
    service: Service, job: Job, text: TextStream, wire: Any, prompt_len: int, include_usage: bool
) -> AsyncIterator[str]:
    n = 0
    finished = written = False
    try:
        head = wire.first()
        if head is not None:
            yield protocol.sse(head)
        async for kind, value in _tokens(service, job, text):
            if kind == "text":
                delta, ids = value
                n += len(ids)
                event = wire.chunk_event(delta, ids)
                if event is not None:
                    yield event
                    if not written:  # resumed: the server has handed the event to the socket
                        written = True
                        service.metrics.ttft_written.observe(time.monotonic() - job.arrival)
            else:
                finished = True
                _done(service, job, n, "ok")
                yield protocol.sse(wire.last(value))
                if include_usage:
                    yield protocol.sse(wire.usage_chunk(protocol.usage(prompt_len, n)))
                yield "data: [DONE]\n\n"
    except ApiError as e:
        finished = True
        _done(service, job, n, "error")
        yield protocol.sse(e.body())
    finally:
        if not finished:  # the client went away mid-stream (the generator was closed)
            _gone(service, job)


def _done(service: Service, job: Job, tokens: int, outcome: str) -> None:
    m = service.metrics
    m.requests.labels(outcome).inc()
    m.completion_tokens.inc(tokens)
    m.in_flight.dec()
    m.finished(job.arrival, time.monotonic())


def _gone(service: Service, job: Job) -> None:
    service.engine.cancel(job)  # type: ignore[union-attr]
    service.metrics.requests.labels("disconnected").inc()
    service.metrics.in_flight.dec()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
