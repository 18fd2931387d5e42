"""The engine's own process (``engine_process`` forks it; the server's side of the pair
is ``EngineProcess`` there): load and warm the release, tell every front, then run the
engine, its receiving thread turning the fronts' messages into submits, cancels and the
close, its model thread sending each iteration's events back (``route``: to the front
that numbered each request) with the measurements ``Relay`` turns into records.

A front that is gone (its end closed or broken) means the server is ending: the engine
exits at once, as it does when the server's process dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Callable
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

SENDS_JOIN_S = 5.0  # before "stopped": the refusals and notices still being sent
TOKENIZERS_WAIT_S = 120.0  # the longest the engine waits for the fronts' tokenizers to load


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

    def prefill(self, bucket: Bucket, real: int, computed: int, folded: bool = False) -> None:
        self.records.append(("prefill", bucket.name, real, computed, folded))

    def step(self, bucket: Bucket, rows: int) -> None:
        self.records.append(("step", bucket.name, rows))

    def slots(self, bucket: Bucket, busy: int) -> None:
        self.records.append(("slots", bucket.name, busy))

    def launch(self, late: bool, lead: float) -> None:
        self.records.append(("launch", late, lead))

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


def run(
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
    state: dict[str, Any] = {"engine": None, "closed": False}
    state_lock = threading.Lock()  # the engine made, against a close that came first
    tokenized: set[int] = set()  # the fronts whose tokenizers are loaded
    fronts_loading = threading.Condition()
    sends: list[threading.Thread] = []  # later()'s, until sent

    def send(front: int, message: tuple[Any, ...]) -> None:
        try:
            with locks[front]:
                conns[front].send(message)
        except OSError:  # that front is gone: the server is ending
            os._exit(0)

    def send_all(message: tuple[Any, ...]) -> None:
        for front in range(len(conns)):
            send(front, message)

    def send_events(items: list[tuple[int, Any]], records: list[tuple[Any, ...]]) -> None:
        for front, (its, recs) in route(len(conns), items, records).items():
            send(front, ("events", its, recs))

    def later(front: int, message: tuple[Any, ...]) -> None:
        """Sent from a thread of its own: while a front's end blocks sending to us, a send
        from the receiving thread would wait for a reader that waits for us."""
        t = threading.Thread(target=send, args=(front, message), daemon=True)
        t.start()
        # started first: the model thread may join it at once; the sent ones let go
        sends[:] = [*(r for r in sends if r.is_alive()), t]

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

    def receive() -> None:
        while True:
            for conn in wait(conns):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # a front is gone: the server is ending
                    os._exit(0)
                handle(conns.index(conn), message)

    def handle(front: int, message: tuple[Any, ...]) -> None:
        kind, engine = message[0], state["engine"]
        if kind == "submit":
            _, rid, prompt, max_tokens, need, sampling, arrival = message
            req = Request(prompt, max_tokens, need, sampling, arrival=arrival, rid=rid)
            jobs[rid] = req
            try:
                if engine is None:  # fronts submit once ready: not before
                    raise Closed
                engine.submit(req)
            except (QueueFull, Closed, ValueError) as e:
                jobs.pop(rid, None)
                why = Failed(f"refused by the engine: {e!r}", retry=not isinstance(e, ValueError))
                later(front, ("events", [(rid, why)], []))
        elif kind == "tokenizer":
            with fronts_loading:
                tokenized.add(front)
                fronts_loading.notify_all()
        elif kind == "cancel":
            if (req := jobs.pop(message[1], None)) is not None and engine is not None:
                engine.cancel(req)
        elif kind == "close":
            with state_lock:
                first, state["closed"] = not state["closed"], True
                if state["engine"] is not None:
                    state["engine"].close()
            with fronts_loading:  # a drain does not wait for tokenizers
                fronts_loading.notify_all()
            if first:  # every front stops taking requests now, not when its own SIGTERM lands
                for other in range(len(conns)):
                    if other != front:
                        later(other, ("closing",))

    # from the start: a front that dies while the release loads ends the engine at once
    threading.Thread(target=receive, name="inf2-serve-engine-receive", daemon=True).start()
    try:
        model, resident, loaded = load_release(options, loader, lambda p: send_all(("phase", p)))
        # The fronts load their tokenizers while the release loads; the calls the engine
        # times (its policies' costs) wait for them, so that a front's imports do not share
        # the cores with those timings (a bounded wait: a slow tokenizer delays no more).
        with fronts_loading:
            fronts_loading.wait_for(
                lambda: len(tokenized) == len(conns) or state["closed"], TOKENIZERS_WAIT_S
            )
        # the fronts count the queue; a margin here for cancels sent before a submit
        engine = make_engine(
            model,
            resident,
            options,
            None,
            relay,
            startup=loaded.startup,
            deliver=deliver,
            max_queue=2 * options.max_queue,
        )
    except Exception as e:
        from pipeline.errors import PipelineError

        line = e.one_line() if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        try:
            send_all(("failed", e, line))
        except Exception:  # not picklable: the line says it
            send_all(("failed", RuntimeError(line), line))
        return

    gc.collect()
    gc.freeze()
    with state_lock:  # before any front hears "ready" and submits
        state["engine"] = engine
        if state["closed"]:  # the server began draining while the release loaded
            engine.close()
    records = relay.take()
    for front in range(len(conns)):
        send(front, ("ready", loaded, records if front == 0 else []))
    why = None
    try:
        engine.run()
    except EngineFailed as e:  # every request it held was failed
        why = str(e)
    for t in list(sends):  # a refused request hears so before its front hears "stopped"
        t.join(SENDS_JOIN_S)
    send_all(("stopped", why))
