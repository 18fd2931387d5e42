"""The HTTP side: FastAPI routes on uvicorn, and the engine thread that loads, warms up and
then runs the scheduler.

The server listens at once (``/health`` answers while a large release loads); ``/ready``
and the completion route answer 503 until the release is loaded and warm. SIGTERM (uvicorn's
handler): stop accepting, let every in-flight request finish, then stop the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.errors import InputError, PipelineError
from pipeline.server import protocol
from pipeline.server.metrics import Metrics
from pipeline.server.protocol import ApiError
from pipeline.server.scheduler import Closed, QueueFull, Scheduler
from pipeline.server.scheduler import Request as Job
from pipeline.server.tokenizer import TextStream, load_tokenizer

log = logging.getLogger("inf2_pipeline.serve")

RETRY_AFTER_S = 1  # what a 503 asks clients to wait: a batch on the device takes about that
# A prompt longer than this many characters per position of the largest bucket cannot fit
# (natural text averages 3-5 characters a token): refused before the tokenizer spends on it.
MAX_CHARS_PER_POSITION = 64


@dataclass
class ServeOptions:
    path: Path
    host: str = "127.0.0.1"
    port: int = 8000
    max_wait_ms: float = 5.0
    max_queue: int = 256


class Engine:
    """The release, its tokenizer and the scheduler, made ready in a thread of their own
    (which then stays the one thread that runs the model)."""

    def __init__(self, options: ServeOptions, loader: Callable[[Path], Any] | None = None):
        self.options = options
        self.loader = loader or _load_model
        self.metrics = Metrics()
        self.phase = "loading"
        self.error: str | None = None
        self.failure: Exception | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.name = ""
        self.vocab = 0
        self.scheduler: Scheduler | None = None
        self.thread: threading.Thread | None = None
        self.on_failure: Callable[[], None] = lambda: None

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.thread = threading.Thread(
            target=self._main, args=(loop,), name="inf2-serve-model", daemon=True
        )
        self.thread.start()

    def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            model = self.loader(self.options.path)
            self.tokenizer = load_tokenizer(model.dir)
            self.name = model.manifest.model
            self.vocab = model.vocab_size()
            self.phase = "warming up"
            model.warmup()
            # One short run per bucket the runner keeps loaded: first calls pay one-time
            # costs (allocation, lazy init), which belong here and not in the first request's
            # latency. Buckets beyond a memory budget (neuron) load on demand instead.
            for bucket in model.warm_buckets():
                model.session(bucket).generate([[0]], 2, None)
            self.model = model
            self.scheduler = Scheduler(
                model,
                loop,
                max_wait_s=self.options.max_wait_ms / 1000,
                max_queue=self.options.max_queue,
                on_batch=self.metrics.batch,
                on_depth=self.metrics.queue_depth.set,
            )
        except Exception as e:
            self.failure = e
            self.error = (
                e.one_line() if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
            )
            self.phase = "failed"
            self.on_failure()
            return
        self.phase = "ready"
        self.metrics.ready.set(1)
        buckets = ", ".join(b.name for b in model.buckets)
        log.info(
            "ready: %s %s on %s (%s)", self.name, model.manifest.version, model.device, buckets
        )
        self.scheduler.run()

    def drain(self) -> None:
        """Shutting down: take no new requests, run the queued ones now (no more waiting
        for batch partners)."""
        self.metrics.ready.set(0)
        if self.scheduler is not None:
            self.phase = "draining"
            self.scheduler.close()

    async def stop(self) -> None:
        """Finish what is queued, then let the model thread end."""
        self.drain()
        if self.scheduler is not None and self.thread is not None:
            await asyncio.to_thread(self.thread.join)


def create_app(engine: Engine) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        await engine.stop()

    app = FastAPI(title="inf2-pipeline serve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body = {"status": engine.phase}
        if engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=200 if engine.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        if engine.name:
            data.append(
                {"id": engine.name, "object": "model", "created": 0, "owned_by": "inf2-pipeline"}
            )
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            engine.metrics.requests.labels("invalid").inc()
            raise ApiError(400, "the request body is not JSON") from None
        job, req, prompt_len = await _admit(engine, body)
        rid, created = protocol.new_id(), protocol.now()
        text = TextStream(engine.tokenizer, protocol.stop_list(req))
        engine.metrics.in_flight.inc()
        engine.metrics.prompt_tokens.inc(prompt_len)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            gen = _sse(engine, job, text, rid, created, prompt_len, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(engine, job, text))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not collect.done():  # the client left: free its slot
            collect.cancel()
            _gone(engine, job)
            return Response(status_code=499)
        reason, out_text, ids = collect.result()
        return JSONResponse(
            protocol.completion(
                rid,
                engine.name,
                created,
                out_text,
                ids,
                reason,
                protocol.usage(prompt_len, len(ids)),
            )
        )

    return app


async def _admit(engine: Engine, body: Any) -> tuple[Job, protocol.CompletionRequest, int]:
    """Check the request and queue it, or raise the ApiError that answers it."""
    m = engine.metrics
    if not engine.ready or engine.scheduler is None:
        m.requests.labels("not_ready").inc()
        raise ApiError(
            503,
            f"not ready: {engine.phase}",
            code="not_ready",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    try:
        req = protocol.parse_request(body)
        if req.model != engine.name:
            raise ApiError(
                404,
                f"model '{req.model}' is not served here; this server serves '{engine.name}'",
                param="model",
                code="model_not_found",
            )
        prompt = await _token_ids(engine, protocol.one_prompt(req), req)
    except ApiError:
        m.requests.labels("invalid").inc()
        raise
    model = engine.model
    assert req.max_tokens is not None
    need = model.tokens_needed(len(prompt), req.max_tokens)
    if need > model.max_seq:
        m.requests.labels("too_long").inc()
        largest = max(model.buckets, key=lambda b: (b.seq, b.batch))
        raise ApiError(
            400,
            f"prompt of {len(prompt)} tokens + max_tokens {req.max_tokens} needs {need} "
            f"positions; the largest bucket, {largest.name}, holds {model.max_seq}: shorten the "
            "prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    steps = bool(req.stream or protocol.stop_list(req))
    job = Job(prompt=prompt, max_tokens=req.max_tokens, need=need, steps=steps)
    try:
        engine.scheduler.submit(job)
    except QueueFull:
        m.requests.labels("queue_full").inc()
        raise ApiError(
            503,
            f"the queue is full ({engine.scheduler.max_queue} waiting): retry later",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except Closed:
        m.requests.labels("not_ready").inc()
        raise ApiError(503, "shutting down", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return job, req, len(prompt)


async def _token_ids(engine: Engine, prompt: str | list[int], req: Any) -> list[int]:
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ApiError(
                400,
                "this release has no tokenizer: send the prompt as a list of token ids",
                param="prompt",
            )
        limit = engine.model.max_seq * MAX_CHARS_PER_POSITION
        if len(prompt) > limit:
            raise ApiError(
                400,
                f"prompt of {len(prompt)} characters cannot fit the largest bucket "
                f"({engine.model.max_seq} positions): shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
        # Off the event loop: a long prompt must not stall /health and the other requests.
        ids = list((await asyncio.to_thread(engine.tokenizer, prompt)).input_ids)
    else:
        ids = list(prompt)
    # The tokenizer's ids too: one with added tokens beyond the model's embedding would
    # otherwise index past it on the device.
    bad = [t for t in ids if not 0 <= t < engine.vocab]
    if bad:
        source = "the tokenizer gave" if isinstance(prompt, str) else "the prompt has"
        raise ApiError(
            400,
            f"{source} token ids {bad[:5]} outside the model's vocabulary (0..{engine.vocab - 1})",
            param="prompt",
        )
    if protocol.stop_list(req) and engine.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; this release has none", param="stop")
    return ids


async def _tokens(engine: Engine, job: Job, text: TextStream) -> AsyncIterator[tuple[str, Any]]:
    """The job's events as ("text", (delta, ids)) and finally ("done", reason); stops early
    (and frees the row) when a stop string appears."""
    while True:
        kind, value = await job.events.get()
        if kind == "tokens":
            delta = text.push(value)
            yield "text", (delta, value)
            if text.stopped:
                engine.scheduler.cancel(job)  # type: ignore[union-attr]
                yield "done", "stop"
                return
        elif kind == "done":
            yield "text", (text.flush(), [])
            yield "done", value
            return
        else:
            raise ApiError(500, f"generation failed: {value}")


async def _collect(engine: Engine, job: Job, text: TextStream) -> tuple[str, str, list[int]]:
    parts: list[str] = []
    ids: list[int] = []
    first: float | None = None
    try:
        async for kind, value in _tokens(engine, job, text):
            if kind == "text":
                # A whole answer arrives at once: its first token's time is unknown, so
                # only streamed requests feed the TTFT and TPOT histograms.
                if value[1] and first is None and job.steps:
                    first = time.monotonic()
                parts.append(value[0])
                ids += value[1]
            else:
                _done(engine, job, first, len(ids), "ok")
                return value, "".join(parts), ids
    except ApiError:
        _done(engine, job, first, len(ids), "error")
        raise
    raise AssertionError("unreachable")


async def _sse(
    engine: Engine,
    job: Job,
    text: TextStream,
    rid: str,
    created: int,
    prompt_len: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    first: float | None = None
    n = 0
    finished = False
    try:
        async for kind, value in _tokens(engine, job, text):
            if kind == "text":
                delta, ids = value
                if ids and first is None:
                    first = time.monotonic()
                n += len(ids)
                if delta or ids:
                    chunk = protocol.completion(rid, engine.name, created, delta, ids, None)
                    yield _event(chunk)
            else:
                finished = True
                _done(engine, job, first, n, "ok")
                yield _event(protocol.completion(rid, engine.name, created, "", [], value))
                if include_usage:
                    chunk = protocol.completion(rid, engine.name, created, "", [], None)
                    chunk["choices"] = []
                    chunk["usage"] = protocol.usage(prompt_len, n)
                    yield _event(chunk)
                yield "data: [DONE]\n\n"
    except ApiError as e:
        finished = True
        _done(engine, job, first, n, "error")
        yield _event(e.body())
    finally:
        if not finished:  # the client went away mid-stream (the generator was closed)
            _gone(engine, job)


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _done(engine: Engine, job: Job, first: float | None, tokens: int, outcome: str) -> None:
    m = engine.metrics
    m.requests.labels(outcome).inc()
    m.completion_tokens.inc(tokens)
    m.in_flight.dec()
    m.finished(job.arrival, first, time.monotonic(), tokens)


def _gone(engine: Engine, job: Job) -> None:
    engine.scheduler.cancel(job)  # type: ignore[union-attr]
    engine.metrics.requests.labels("disconnected").inc()
    engine.metrics.in_flight.dec()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _load_model(path: Path) -> Any:
    from pipeline.runtime import BucketedModel

    return BucketedModel.load(path)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port or a wrong host is one line
    naming the option (uvicorn would log a traceback-like block and exit 1 or 3). IPv6 only
    for a host with ':', as uvicorn does: `localhost` is 127.0.0.1 even where it is also ::1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except (OSError, UnicodeError, OverflowError) as e:
        sock.close()
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            raise InputError(
                f"--host {host} --port {port}",
                "cannot listen: in use by another process",
                "pick another --port",
            ) from None
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(
            f"--host {host}",
            f"cannot listen there ({why})",
            "pass an address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
        ) from None
    return sock


def serve(options: ServeOptions) -> None:
    """Run the server until SIGTERM/SIGINT; raises the load error if the release failed."""
    import uvicorn

    sock = _listen(options.host, options.port)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # uvicorn names its address only for sockets it binds itself; --port 0 needs the real one.
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    engine = Engine(options)
    config = uvicorn.Config(
        create_app(engine),
        host=options.host,
        port=options.port,
        access_log=False,
        log_level="info",
        lifespan="on",
        timeout_keep_alive=5,
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            engine.drain()  # at once: queued requests must not wait out --max-wait-ms
            await super().shutdown(sockets)

    server = Server(config)

    def failed() -> None:
        server.should_exit = True

    engine.on_failure = failed
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler that was there
    # before it: this one, so that a clean drain exits 0 rather than dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    with sock:
        server.run(sockets=[sock])
    if isinstance(engine.failure, PipelineError):
        raise engine.failure
    if engine.failure is not None:
        raise PipelineError(f"serve {options.path}", engine.error or "failed to load")
