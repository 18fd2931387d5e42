"""The engine in a process of its own, and the server's handle on it.

Why: in one process the model thread and the event loop share a GIL. Between device calls
the model thread must win it back from a loop that streams thousands of tokens a second, so
the device idles: on the H200 it was busy ~68 % of the long replay (bench/RESULTS.md,
thirteenth round) while the engine's own work was 0.26 s of 2.8. vLLM splits the same way
(its V1 ``EngineCore`` runs in a background process behind ``core_client.py``): HTTP,
tokenizing and detokenizing in the server's process, scheduling and the device in the
engine's.

The server's process forks the engine's before its event loop starts (no threads yet, and
no CUDA or Neuron runtime: the release is loaded in the child). They speak over a socket
pair, one message per engine iteration the other way:

- server → engine: ``("submit", rid, prompt, max_tokens, need, sampling, arrival)``,
  ``("cancel", rid)``, ``("close",)``;
- engine → server: ``("phase", name)``, ``("ready", Loaded, records)`` or
  ``("failed", exception, one line)``, then ``("events", items, records)`` per
  iteration (an item is ``(rid, token)``, ``(rid, "stop" | "length")`` or
  ``(rid, Failed)``; records are the engine's measurements, replayed into the server's
  ``Metrics``), and finally ``("stopped", None | why the engine gave up)``.

The server enforces ``max_queue`` itself (a request leaves its count when the engine's
records say it was admitted), so a full queue is still a 503 at once. The engine ignores
SIGINT and SIGTERM (the server drains it); it exits when the server's end closes, and the
kernel kills it if the server dies (``PR_SET_PDEATHSIG``): it never outlives the server.
If it dies, every request it held fails and the server stops, as after ``EngineFailed``.

With ``--http-workers N`` (``pipeline.server.fronts``) the engine has one socket pair per HTTP
process and multiplexes them: front ``i`` numbers its requests ``i + 1, i + 1 + N, ...``, so
a request's events go back to the front that sent it; the engine's own measurements go to
front 0 (the metrics of all fronts are summed at ``/metrics``), an admission to the front
whose queue count it lowers. The queue count is one integer in shared memory, so
``--max-queue`` bounds the requests waiting in all fronts together.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline._procs import killed_with_parent
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
        # the requests waiting in every front (a multiprocessing.Value shared by all)
        self._queued = queued if queued is not None else multiprocessing.Value("i", 0)
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
        proc = ctx.Process(
            target=_engine_main,
            args=(theirs, mine, options, loader, list(close), os.getpid()),
            name="inf2-serve-engine",
            daemon=True,
        )
        proc.start()
        for t in theirs:
            t.close()
        queued = ctx.Value("i", 0)
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
        return self._queued.value

    def submit(self, req: Request) -> None:
        if req.need > self.largest.seq:
            raise ValueError(f"a request of {req.need} positions fits no resident bucket")
        if self._closing:
            raise Closed
        with self._queued.get_lock():
            if self._queued.value >= self.max_queue:
                raise QueueFull
            self._queued.value += 1
        req.rid, self._next = self._next, self._next + self._stride
        message = ("submit", req.rid, req.prompt, req.max_tokens, req.need, req.sampling)
        try:
            self.conn.send((*message, req.arrival))
        except OSError:  # the engine's process is gone: _lost says so to everyone
            self._unqueue(1)
            raise Closed from None
        self._jobs[req.rid] = req
        self._waiting.add(req.rid)

    def _unwait(self, rid: int) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            self._unqueue(1)

    def _unqueue(self, n: int) -> None:
        with self._queued.get_lock():
            self._queued.value -= n

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        if self._jobs.pop(req.rid, None) is not None:
            self._unwait(req.rid)
            with contextlib.suppress(OSError):
                self.conn.send(("cancel", req.rid))

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
                self._records(message[2])
                self._events(message[1])
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
            elif kind == "stopped":
                self._finish()
                if message[1] is not None:
                    self._fail_all(message[1])
                    self.listener.engine_failed(message[1])
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
            elif kind == "engine_time":
                m.engine_time(*r[1:])
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
        if os.getpid() == self._owner:
            self.proc.join(1.0)
            code = self.proc.exitcode
            how = f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"
        else:
            how = "ended"
        message = f"the engine's process {how}"
        self._fail_all(message)
        if self.loaded is None and self.listener.phase != "failed":
            self.listener.load_failed(EngineFailed(message), f"EngineFailed: {message}")
        elif self.listener.phase != "failed":
            self.listener.engine_failed(message)

    def _fail_all(self, message: str) -> None:
        for req in self._jobs.values():
            req.events.put_nowait(Failed(message))
        self._jobs.clear()
        self._unqueue(len(self._waiting))
        self._waiting.clear()


class Relay:
    """The engine's ``Hooks`` in its own process: each measurement as a record, sent with
    the iteration's events and replayed into the server's ``Metrics``."""

    def __init__(self, flush: Callable[[list[tuple[Any, ...]]], None]) -> None:
        self.records: list[tuple[Any, ...]] = []
        self.flush = flush  # sends records that no events carried
        self._time = [0.0, 0.0, 0.0, 0.0]  # the model thread's split since the last take

    def take(self) -> list[tuple[Any, ...]]:
        # appends from the receiving thread (queue_depth) between the two steps are kept
        n = len(self.records)
        out = self.records[:n]
        del self.records[:n]
        if any(self._time):
            out.append(("engine_time", *self._time))
            self._time = [0.0, 0.0, 0.0, 0.0]
        return out

    def queue_depth(self, n: int) -> None:
        self.records.append(("queue_depth", n))

    def admitted(self, req: Request, now: float) -> None:
        self.records.append(("admitted", req.rid, now - req.arrival))

    def token(self, req: Request, now: float) -> None:
        if req.produced == 1:
            self.records.append(("ttft", now - req.arrival))
        else:
            self.records.append(("itl", now - req.last_token))

    def prefill(self, bucket: Bucket, real: int, computed: int) -> None:
        self.records.append(("prefill", bucket.name, real, computed))

    def step(self, bucket: Bucket, rows: int) -> None:
        self.records.append(("step", bucket.name, rows))

    def slots(self, bucket: Bucket, busy: int) -> None:
        self.records.append(("slots", bucket.name, busy))

    def engine_time(self, wait: float, prefill: float, step: float, other: float) -> None:
        """The end of an iteration: its time goes with the next events; what this iteration
        measured and no events carried (a slot freed for a client that left) goes now."""
        t = self._time
        t[0] += wait
        t[1] += prefill
        t[2] += step
        t[3] += other
        if self.records:
            self.flush(self.take())

    def idle(self) -> None:
        """Nothing to do: what was measured goes now, not when work comes."""
        if self.records or any(self._time):
            self.flush(self.take())


def route(
    fronts: int, items: list[tuple[int, Any]], records: list[tuple[Any, ...]]
) -> dict[int, tuple[list[tuple[int, Any]], list[tuple[Any, ...]]]]:
    """An iteration's events and records by front: a request's events to the front that
    numbered it, an admission to the front whose queue count it lowers, every other record
    to front 0 (whose metrics ``/metrics`` sums with the others'). Fronts with nothing to
    hear are left out."""
    out: dict[int, tuple[list[tuple[int, Any]], list[tuple[Any, ...]]]] = {}
    if fronts == 1:
        return {0: (items, records)} if items or records else {}
    for item in items:
        out.setdefault((item[0] - 1) % fronts, ([], []))[0].append(item)
    for r in records:
        front = (r[1] - 1) % fronts if r[0] == "admitted" else 0
        out.setdefault(front, ([], []))[1].append(r)
    return out


def _engine_main(
    conns: list[Any],
    theirs: list[Any],
    options: Any,
    loader: Callable[[Path], Any],
    close: list[Any],
    server_pid: int,
) -> None:
    """The engine's process: load, warm, tell the fronts, run the engine until closed."""
    from multiprocessing.connection import wait

    from pipeline.server.loading import load_release, make_engine

    for end in [*theirs, *close]:
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the whole group: the server drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    killed_with_parent(server_pid)
    # the model thread sends, and the receiver for a refusal: one lock per front's end
    locks = [threading.Lock() for _ in conns]

    def send(front: int, message: tuple[Any, ...]) -> None:
        with locks[front]:
            conns[front].send(message)

    def send_all(message: tuple[Any, ...]) -> None:
        for front in range(len(conns)):
            send(front, message)

    def send_events(items: list[tuple[int, Any]], records: list[tuple[Any, ...]]) -> None:
        for front, (its, recs) in route(len(conns), items, records).items():
            send(front, ("events", its, recs))

    relay = Relay(lambda records: send_events([], records))
    jobs: dict[int, Request] = {}

    def deliver(out: list[tuple[Request, Event]]) -> None:
        items: list[tuple[int, Any]] = []
        for req, event in out:
            if isinstance(event, Tokens):
                items += [(req.rid, t) for t in event.ids]
                continue
            jobs.pop(req.rid, None)
            items.append((req.rid, event.reason if isinstance(event, Finished) else event))
        send_events(items, relay.take())

    try:
        model, resident, loaded = load_release(options, loader, lambda p: send_all(("phase", p)))
        # the fronts count the queue; a margin here for cancels sent before a submit
        engine = make_engine(
            model, resident, options, None, relay, deliver=deliver, max_queue=2 * options.max_queue
        )
    except Exception as e:
        from pipeline.errors import PipelineError

        line = e.one_line() if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        try:
            send_all(("failed", e, line))
        except Exception:  # not picklable: the line says it
            send_all(("failed", RuntimeError(line), line))
        return

    def receive() -> None:
        while True:
            for conn in wait(conns):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # a front is gone: the server is ending
                    os._exit(0)
                handle(conns.index(conn), message)

    def handle(front: int, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            _, rid, prompt, max_tokens, need, sampling, arrival = message
            req = Request(prompt, max_tokens, need, sampling, arrival=arrival, rid=rid)
            jobs[rid] = req
            try:
                engine.submit(req)
            except (QueueFull, Closed, ValueError) as e:
                jobs.pop(rid, None)
                # not from this thread: while the front's end blocks sending to us, a send
                # here would wait for a reader that waits for us
                refusal = ("events", [(rid, Failed(f"refused by the engine: {e!r}"))], [])
                threading.Thread(target=send, args=(front, refusal), daemon=True).start()
        elif kind == "cancel":
            if (req := jobs.pop(message[1], None)) is not None:
                engine.cancel(req)
        elif kind == "close":
            engine.close()

    gc.collect()
    gc.freeze()
    records = relay.take()
    for front in range(len(conns)):
        send(front, ("ready", loaded, records if front == 0 else []))
    threading.Thread(target=receive, name="inf2-serve-engine-receive", daemon=True).start()
    why = None
    try:
        engine.run()
    except EngineFailed as e:  # every request it held was failed
        why = str(e)
    send_all(("stopped", why))
