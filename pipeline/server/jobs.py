"""A job: one request as the engine holds it, and what the engine tells it (``Tokens``,
then ``Finished`` or ``Failed``); the engine's refusals (``QueueFull``, ``Closed``) and its
failure (``EngineFailed``); the hooks its measurements go to (``Hooks``). What the engine,
the HTTP side and the engine's process share (``pipeline.server.engine`` runs them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.contracts.bucket import Bucket
from pipeline.runtime.sampling import GREEDY, SamplingParams


class EngineFailed(Exception):
    """The engine cannot go on (the device keeps failing, or a bug): the server is unhealthy."""


class QueueFull(Exception):
    """The bounded queue is full: answer 503 with Retry-After."""


class Closed(Exception):
    """The engine is shutting down: no new requests."""


# --- what the engine tells a request (on its asyncio queue) -----------------------------


@dataclass(frozen=True)
class Tokens:
    ids: list[int]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (EOS) or "length" (max_tokens)


@dataclass(frozen=True)
class Failed:
    message: str
    # 503: refused because the server is draining (a request a front sent as the engine
    # closed), which a client may retry elsewhere; 500: generation failed
    retry: bool = False


Event = Tokens | Finished | Failed


@dataclass(eq=False)
class Request:
    """One completion request. ``events`` (an asyncio.Queue on the loop) receives ``Tokens``,
    then ``Finished`` or ``Failed``."""

    prompt: list[int]
    max_tokens: int
    need: int  # sequence positions a slot must have for it
    sampling: SamplingParams = GREEDY  # the slot draws under these; greedy by default
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    rid: int = 0  # its number between the server's process and the engine's
    cancelled: bool = False  # set from the loop: the client left, or a stop string matched
    # the engine's own: tokens launched on the device, sent so far, and when the last was
    launched: int = 0
    produced: int = 0
    last_token: float = 0.0
    passed_over: bool = False  # left waiting while a later request was admitted


class Hooks(Protocol):
    """The engine's measurements (``pipeline.server.metrics.Metrics`` implements them)."""

    def queue_depth(self, n: int) -> None: ...
    def admitted(self, req: Request, now: float) -> None: ...
    def token(self, req: Request, now: float) -> None: ...
    def prefill(self, bucket: Bucket, real: int, computed: int, folded: bool = False) -> None: ...
    def step(self, bucket: Bucket, rows: int) -> None: ...
    def slots(self, bucket: Bucket, busy: int) -> None: ...
    def engine_time(self, wait: float, prefill: float, step: float, other: float) -> None: ...
    def launch(self, late: bool, lead: float) -> None: ...  # a held launch (pacing)
    def idle(self) -> None: ...  # about to wait for work


class NoHooks:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def sampling_args(reqs: list[Request]) -> tuple[Any, ...]:
    """The sampling argument of a prefill call: none where every request is greedy (so
    slots that only decode greedily need not take one)."""
    if all(r.sampling.greedy for r in reqs):
        return ()
    return ([r.sampling for r in reqs],)


def first_tokens_first(out: list[tuple[Request, Event]]) -> list[tuple[Request, Event]]:
    """A batch of events with the requests whose first token it holds moved ahead, each
    request's own events in their order. Why: the HTTP front wakes one stream per event in
    the order they come, and with 32 streams a step's events take it milliseconds to write
    (bench/RESULTS.md, twentieth round); a running row's next token is as late by the few
    first tokens put before it as a new request's first token would be by all of them."""
    if len(out) < 2:
        return out
    got: dict[int, int] = {}  # tokens in this batch, by request
    for req, event in out:
        if isinstance(event, Tokens):
            got[id(req)] = got.get(id(req), 0) + len(event.ids)
    # every token it has produced is in this batch: its first is too
    first = {id(r) for r, _ in out if r.produced == got.get(id(r), -1)}
    if not first or len(first) == len({id(r) for r, _ in out}):
        return out  # nothing to move, or nothing to move past
    return [o for o in out if id(o[0]) in first] + [o for o in out if id(o[0]) not in first]


def put_events(items: list[tuple[Request, Event]]) -> None:
    """Each event onto its request's queue (on the event loop)."""
    for r, event in items:
        r.events.put_nowait(event)
