"""The engine in a process of its own, and the server's handle on it.

Why: in one process the model thread and the event loop share a GIL. Between device calls
the model thread must win it back from a loop that streams thousands of tokens a second, so
the device idles: on the H200 it was busy ~68 % of the long replay (bench/RESULTS.md,
thirteenth round) while the engine's own work was 0.26 s of 2.8. vLLM splits the same way
(its V1 ``EngineCore`` runs in a background process behind ``core_client.py``): HTTP,
tokenizing and detokenizing in the server's process, scheduling and the device in the
engine's.

The server's process forks the engine's before its event loop starts (no threads yet, and
no CUDA or Neuron runtime: the release is loaded in the child; its side is
``engine_main``). They speak over a socket pair, one message per engine iteration the other
way:

- server → engine: ``("submit", rid, prompt, max_tokens, need, sampling, arrival)``,
  ``("cancel", rid)``, ``("close",)``;
- engine → server: ``("phase", name)``, ``("ready", Loaded, records)`` or
  ``("failed", exception, one line)``, then ``("events", items, records)`` per
  iteration (an item is ``(rid, token)``, ``(rid, "stop" | "length")`` or
  ``(rid, Failed)``; records are the engine's measurements, replayed into the server's
  ``Metrics``), ``("closing",)`` to the other fronts when one sends the close, and finally
  ``("stopped", None | why the engine gave up)``.

The server enforces ``max_queue`` itself (a request leaves its count when the engine's
records say it was admitted), so a full queue is still a 503 at once. The engine ignores
SIGINT and SIGTERM (the server drains it); it exits when the server's end closes, and the
kernel kills it if the server dies (``PR_SET_PDEATHSIG``): it never outlives the server.
If it dies, every request it held fails and the server stops, as after ``EngineFailed``.

With ``--http-workers N`` (``pipeline.server.fronts``) the engine has one socket pair per HTTP
process and multiplexes them: front ``i`` numbers its requests ``i + 1, i + 1 + N, ...``, so
a request's events go back to the front that sent it; the engine's own measurements go to
front 0 (the metrics of all fronts are summed at ``/metrics``), an admission to the front
whose queue count it lowers. Each front counts what it has waiting in its own place of a
shared array, and reads them all, so ``--max-queue`` bounds the requests waiting in every
front together (to within N - 1: two fronts may take the last place at once), with no lock
that a front killed mid-update could leave held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline._procs import how_it_ended
from pipeline.contracts.bucket import Bucket
from pipeline.server.jobs import (
    Closed,
    EngineFailed,
    Event,
    Failed,
    Finished,
    QueueFull,
    Request,
    Tokens,
)

log = logging.getLogger("inf2_pipeline.serve")

JOIN_S = 10.0  # after "stopped", how long the engine's process may take to exit


class EngineProcess:
    """The server's side: the engine's interface to admission and the routes (``submit``,
    ``cancel``, ``close``, ``largest``, ``max_queue``, ``depth``), answered by the engine's
    process. Every method runs on the event loop."""

    def __init__(
        self,
        proc: Any,
        conn: Any,
        max_queue: int,
        listener: Any,
        queued: Any = None,
        front: int = 0,
        fronts: int = 1,
    ) -> None:
        self.proc = proc
        self.conn = conn
        self.max_queue = max_queue
        self.listener = listener  # the Service: engine_phase, engine_ready, load_failed...
        self.metrics: Any = None
        self.loaded: Any = None  # service.Loaded, once ready
        self._buckets: dict[str, Bucket] = {}
        self._jobs: dict[int, Request] = {}  # rid -> request, until its end is delivered
        self._waiting: set[int] = set()  # submitted, not admitted yet
        # the requests waiting in each front: a shared array, each front writing only its own
        # count (no lock a front killed mid-update could leave held), every front reading all
        self._queued = queued if queued is not None else multiprocessing.Array("i", 1, lock=False)
        self.front = front
        self._next, self._stride = front + 1, fronts  # this front's request numbers
        self._owner = os.getpid()  # the engine's parent: only it may join or kill it
        self._closing = False
        self._done: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def fork(
        cls,
        options: Any,
        loader: Callable[[Path], Any],
        listener: Any,
        close: Sequence[Any] = (),
        fronts: int = 1,
    ) -> list[EngineProcess]:
        """The engine's process, and one handle on it per front (HTTP process) to be: the
        first is this process's; front ``i`` takes the ``i``-th once forked
        (``only_this``)."""
        ctx = multiprocessing.get_context("fork")
        pairs = [ctx.Pipe() for _ in range(fronts)]  # socket pairs: both ways, large buffers
        mine = [m for m, _ in pairs]
        theirs = [t for _, t in pairs]
        from pipeline.server import engine_main

        proc = ctx.Process(
            target=engine_main.run,
            args=(theirs, mine, options, loader, list(close), os.getpid()),
            name="inf2-serve-engine",
            daemon=True,
        )
        proc.start()
        for t in theirs:
            t.close()
        queued = ctx.Array("i", fronts, lock=False)
        return [
            cls(proc, m, options.max_queue, listener, queued, front=i, fronts=fronts)
            for i, m in enumerate(mine)
        ]

    def only_this(self, others: Sequence[EngineProcess]) -> EngineProcess:
        """In the front that owns this handle: close the other fronts' ends, so that the
        engine sees a front's end close when that front's process ends."""
        for other in others:
            if other is not self:
                other.conn.close()
        return self

    def attach(self, loop: asyncio.AbstractEventLoop, metrics: Any) -> EngineProcess:
        """Start reading the engine's messages on the loop."""
        self._loop, self.metrics, self._done = loop, metrics, asyncio.Event()
        loop.add_reader(self.conn.fileno(), self._readable)
        return self

    # --- what admission and the routes call ------------------------------------------------

    @property
    def largest(self) -> Bucket:
        return self.loaded.largest

    @property
    def depth(self) -> int:
        return sum(self._queued)

    def submit(self, req: Request) -> None:
        if req.need > self.largest.seq:
            raise ValueError(f"a request of {req.need} positions fits no resident bucket")
        if self._closing:
            raise Closed
        # two fronts may both take the last place: the bound is exact to within N - 1
        if self.depth >= self.max_queue:
            raise QueueFull
        req.rid, self._next = self._next, self._next + self._stride
        message = ("submit", req.rid, req.prompt, req.max_tokens, req.need, req.sampling)
        try:
            self.conn.send((*message, req.arrival))
        except OSError:  # the engine's process is gone: _lost says so to everyone
            raise Closed from None
        self._queued[self.front] += 1
        self._jobs[req.rid] = req
        self._waiting.add(req.rid)

    def _unwait(self, rid: int) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            self._unqueue(1)

    def _unqueue(self, n: int) -> None:
        self._queued[self.front] -= n

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        if self._jobs.pop(req.rid, None) is not None:
            self._unwait(req.rid)
            with contextlib.suppress(OSError):
                self.conn.send(("cancel", req.rid))

    def tokenizer_loaded(self) -> None:
        """This front's tokenizer is loaded (or failed to): the engine times its calls once
        every front's is (``engine_main``)."""
        with contextlib.suppress(OSError):
            self.conn.send(("tokenizer",))

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            with contextlib.suppress(OSError):
                self.conn.send(("close",))

    async def wait(self) -> None:
        """Until the engine has finished what it held and its process exited."""
        if self._done is not None:
            await self._done.wait()
        if os.getpid() == self._owner:  # another front's "stopped" is its own to wait for
            await asyncio.to_thread(self.proc.join, JOIN_S)
            self.kill()

    def kill(self) -> None:
        if os.getpid() == self._owner and self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    # --- what the engine's process says ------------------------------------------------------

    def read_pending(self) -> None:
        """What the engine sent that the loop has not read yet, now."""
        if self._done is not None and not self._done.is_set():
            self._readable()

    def _readable(self) -> None:
        while True:
            try:
                if not self.conn.poll():
                    return
                message = self.conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            kind = message[0]
            if kind == "events":
                # tokens to their streams first: the measurements can wait that long
                self._events(message[1])
                self._records(message[2])
            elif kind == "phase":
                self.listener.engine_phase(message[1])
            elif kind == "ready":
                self.loaded = message[1]
                self._buckets = {b.name: b for b in self.loaded.buckets}
                for b in self.loaded.buckets if self.front == 0 else ():  # one setter
                    self.metrics.slots(b, 0)
                self._records(message[2])
                self.listener.engine_ready(self.loaded)
            elif kind == "failed":
                self._finish()
                self.listener.load_failed(message[1], message[2])
                return
            elif kind == "closing":  # another front began the drain: take no more here
                self._closing = True
                self.listener.engine_closing()
            elif kind == "stopped":
                self._finish()
                if message[1] is not None:
                    self._fail_all(message[1])
                    self.listener.engine_failed(message[1])
                elif self._jobs:  # sent as the engine stopped: never reached it
                    self._fail_all("the server is shutting down", retry=True)
                return

    def _events(self, items: list[tuple[int, Any]]) -> None:
        jobs = self._jobs
        for rid, what in items:
            req = jobs.get(rid)
            if req is None:  # cancelled here; the engine had not heard yet
                continue
            event: Event
            if isinstance(what, int):
                event = Tokens([what])
            else:
                event = Finished(what) if isinstance(what, str) else what
                del jobs[rid]
                self._unwait(rid)
            req.events.put_nowait(event)

    def _records(self, records: list[tuple[Any, ...]]) -> None:
        m = self.metrics
        for r in records:
            kind = r[0]
            if kind == "ttft":
                m.ttft.observe(r[1])
            elif kind == "itl":
                m.itl.observe(r[1])
            elif kind == "admitted":
                self._unwait(r[1])
                m.queue_time.observe(r[2])
            elif kind == "queue_depth":
                m.queue_depth(r[1])
            elif kind in ("engine_time", "launch"):
                getattr(m, kind)(*r[1:])
            else:  # prefill, step, slots: by bucket
                getattr(m, kind)(self._buckets[r[1]], *r[2:])

    def _finish(self) -> None:
        """No more messages: stop reading."""
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.conn.fileno())
        self._closing = True
        if self._done is not None:
            self._done.set()

    def _lost(self) -> None:
        """The engine's process closed its end without saying it stopped: it died."""
        self._finish()
        how = how_it_ended(self.proc) if os.getpid() == self._owner else "ended"
        message = f"the engine's process {how}"
        self._fail_all(message)
        if self.loaded is None and self.listener.phase != "failed":
            self.listener.load_failed(EngineFailed(message), f"EngineFailed: {message}")
        elif self.listener.phase != "failed":
            self.listener.engine_failed(message)

    def _fail_all(self, message: str, retry: bool = False) -> None:
        for req in self._jobs.values():
            req.events.put_nowait(Failed(message, retry))
        self._jobs.clear()
        self._unqueue(len(self._waiting))
        self._waiting.clear()
