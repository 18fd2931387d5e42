"""Batching: waiting requests → groups → the bucket that wastes the fewest padded tokens.

The asyncio side ``submit``s requests (never blocking: a short lock, no model work); one
worker thread (``run``) takes groups off the queue and runs them, because a runner is not
re-entrant (one KV cache per bucket). Tokens go back to the event loop through
``loop.call_soon_threadsafe`` as they are produced, one call per step for the whole batch.

How a group is formed, when the worker is free:
- it waits until ``max_batch`` requests are queued or the oldest has waited ``max_wait_s``;
- the oldest request always goes first (nothing starves); the others join in order of how
  close their need (prompt + max_tokens) is to the oldest one's, while the group still fits
  a bucket, up to the largest batch: similar lengths share a sequence bucket;
- the bucket is ``model.select(len(group), need)``: the fewest padded tokens.

A group runs for the longest max_tokens in it; each request takes its own first max_tokens
tokens (greedy, so a prefix of a longer run is the same answer), and the batch stops as soon
as every row is finished (EOS, its max_tokens, a stop string, or a gone client).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.plan.buckets import Bucket


class Model(Protocol):
    """What the scheduler needs of ``pipeline.runtime.BucketedModel``."""

    buckets: list[Bucket]
    max_batch: int
    max_seq: int
    eos_token_id: int | None

    def select(self, batch: int, seq: int) -> Bucket: ...
    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int: ...
    def session(self, bucket: Bucket) -> Any: ...


class QueueFull(Exception):
    """The bounded queue is full: answer 503 with Retry-After."""


class Closed(Exception):
    """The scheduler is shutting down: no new requests."""


@dataclass(eq=False)
class Request:
    """One completion request. ``events`` (an asyncio.Queue on the loop) receives
    ("tokens", [ids]), then ("done", finish_reason) or ("error", message)."""

    prompt: list[int]
    max_tokens: int
    need: int  # sequence positions a bucket must have for it
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    steps: bool = False  # wants tokens as they come (streaming, stop strings)
    cancelled: bool = False  # set from the loop: the client left, or a stop string matched
    bucket: Bucket | None = None


# The worker's hooks into metrics (kept abstract so the scheduler has no prometheus import).
BatchHook = Callable[[Bucket, int, int], None]  # bucket, rows, real tokens
DepthHook = Callable[[int], None]


class Scheduler:
    def __init__(
        self,
        model: Model,
        loop: asyncio.AbstractEventLoop,
        *,
        max_wait_s: float,
        max_queue: int,
        on_batch: BatchHook | None = None,
        on_depth: DepthHook | None = None,
    ) -> None:
        self.model = model
        self.loop = loop
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._on_batch = on_batch or (lambda *a: None)
        self._on_depth = on_depth or (lambda n: None)
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.running: list[Request] = []

    # --- the event loop's side: never blocks on the model ---------------------------------

    def submit(self, req: Request) -> None:
        with self._cond:
            if self._closing:
                raise Closed
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(req)
            self._on_depth(len(self._queue))
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """The client is gone (or needs no more tokens): free its queue slot, or its row."""
        req.cancelled = True
        with self._cond:
            if req in self._queue:
                self._queue.remove(req)
                self._on_depth(len(self._queue))
                self._cond.notify()

    def close(self) -> None:
        """Take no new requests; the worker finishes what is queued, then returns."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        return len(self._queue)

    # --- the worker thread -------------------------------------------------------------------

    def run(self) -> None:
        while True:
            group = self._next_group()
            if group is None:
                return
            self._run(*group)

    def _next_group(self) -> tuple[list[Request], Bucket] | None:
        with self._cond:
            while True:
                if not self._queue:
                    if self._closing:
                        return None
                    self._cond.wait()
                    continue
                deadline = self._queue[0].arrival + self.max_wait_s
                wait = deadline - time.monotonic()
                if len(self._queue) < self.model.max_batch and wait > 0 and not self._closing:
                    self._cond.wait(wait)
                    continue  # re-check: more came, the oldest left, or time is up
                group, bucket = pick_group(list(self._queue), self.model)
                for r in group:
                    self._queue.remove(r)
                self._on_depth(len(self._queue))
                return group, bucket

    def _run(self, group: list[Request], bucket: Bucket) -> None:
        eos = self.model.eos_token_id
        n = len(group)
        seen = [0] * n  # tokens produced for the row so far
        sent = [0] * n  # of which delivered
        finished = [False] * n
        self.running = group
        for r in group:
            r.bucket = bucket

        def on_tokens(step: Sequence[int]) -> bool:
            out: list[tuple[Request, list[int]]] = []
            for i, (r, t) in enumerate(zip(group, step, strict=True)):
                if finished[i]:
                    continue
                if r.cancelled:
                    finished[i] = True
                    continue
                seen[i] += 1
                if r.steps:
                    out.append((r, [int(t)]))
                    sent[i] += 1
                if int(t) == eos or seen[i] >= r.max_tokens:
                    finished[i] = True
            if out:  # one wake-up of the loop per step, for every streaming row
                self.loop.call_soon_threadsafe(_deliver, out)
            return all(finished)

        try:
            session = self.model.session(bucket)
            prompts = [r.prompt for r in group]
            max_new = max(r.max_tokens for r in group)
            # Per-step tokens only when a row needs them: reading them is a host sync per
            # step (on cuda), and whole answers need none.
            if any(r.steps for r in group) and _streams(session):
                rows = session.generate(prompts, max_new, eos, on_tokens=on_tokens)
            else:
                rows = session.generate(prompts, max_new, eos)
        except Exception as e:  # the request fails, the server lives on
            msg = f"{type(e).__name__}: {e}"
            self.loop.call_soon_threadsafe(_deliver, [(r, ("error", msg)) for r in group])
            self.running = []
            return
        late: list[tuple[Request, Any]] = []
        real = 0
        for i, r in enumerate(group):
            answer = rows[i][: r.max_tokens]
            if not r.cancelled and len(answer) > sent[i]:
                late.append((r, answer[sent[i] :]))
            real += self.model.tokens_needed(len(r.prompt), max(len(answer), 1))
            reason = "stop" if answer and eos is not None and answer[-1] == eos else "length"
            late.append((r, ("done", reason)))
        self.running = []
        self._on_batch(bucket, n, real)
        self.loop.call_soon_threadsafe(_deliver, late)


def pick_group(waiting: list[Request], model: Model) -> tuple[list[Request], Bucket]:
    """The oldest request, joined by those closest to it in need while a bucket holds them
    all (up to the largest batch); and the bucket with the fewest padded tokens for them."""
    head = waiting[0]
    group = [head]
    others = sorted(waiting[1:], key=lambda r: (abs(r.need - head.need), r.arrival))
    for r in others:
        if len(group) >= model.max_batch:
            break
        if _bucket_for([*group, r], model) is not None:
            group.append(r)
    bucket = _bucket_for(group, model)
    assert bucket is not None  # the head alone fits: submit checked it
    return group, bucket


def group_need(group: Sequence[Request], model: Model) -> int:
    """One session runs every row for the longest max_tokens: its cache must hold the longest
    prompt plus that many tokens."""
    return model.tokens_needed(max(len(r.prompt) for r in group), max(r.max_tokens for r in group))


def _bucket_for(group: Sequence[Request], model: Model) -> Bucket | None:
    need = group_need(group, model)
    if need > model.max_seq or len(group) > model.max_batch:
        return None
    try:
        return model.select(len(group), need)
    except ValueError:  # InputError: the grid has no bucket with both
        return None


def _deliver(items: list[tuple[Request, Any]]) -> None:
    for r, item in items:
        r.events.put_nowait(("tokens", item) if isinstance(item, list) else item)


_STREAMS: dict[type, bool] = {}


def _streams(session: Any) -> bool:
    """Whether the session's generate takes ``on_tokens`` (cpu/cuda do; a runner that does
    not still serves, with whole answers)."""
    cls = type(session)
    if cls not in _STREAMS:
        try:
            _STREAMS[cls] = "on_tokens" in inspect.signature(session.generate).parameters
        except (TypeError, ValueError):
            _STREAMS[cls] = False
    return _STREAMS[cls]
