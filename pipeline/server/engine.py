"""The serving loop: iteration-level batching over the resident buckets' slots.

The asyncio side ``submit``s requests (never blocking: a short lock, no model work); one
model thread (``run``) loops, because a runner is not re-entrant. Every iteration:

1. retires rows whose client left (or whose stop string matched), freeing their slots;
2. admits waiting requests into free slots (``placement.place``: first come, first served,
   or shortest prompt first with ``admit_order``, at most ``max_prefills``, within
   ``prefill_stall``) and launches their prefills
   (``placement.prefill_calls``), but for the prompts of each bucket that may ride in the
   bucket's step, packed into one stream (``placement.fold_prompts``);
3. launches one decode step for every bucket with rows that have tokens to launch, with
   those prompts in it where there are any (a mixed call; ``engine_calls``);
4. reads tokens and delivers each row's: with ``overlap`` (slots that ``launch``: cpu/cuda)
   the previous iteration's steps first, which the device finished while this iteration's
   calls queued behind them (their tokens sent at once when prefills are still to be read),
   then this iteration's prefills, whose steps are read at the next iteration; otherwise
   (neuron, or ``overlap=False``) the prefills before step 3 and the steps right after it;
5. retires each row the moment its end is read (EOS, its own ``max_tokens``), so the slot
   is free for the next iteration's admissions. Under overlap a row that ended at EOS was
   already launched once more: that token is dropped (``Launched.theirs``). A row whose last
   token by ``max_tokens`` is launched is not stepped again.

So a short request never waits for a long one's steps, the device does not wait for the
host between steps, and a freed slot is refilled one or two iterations later. Tokens go
back as typed events (``Tokens``, ``Finished``, ``Failed``), one ``deliver`` an iteration
for every request (to the event loop, or to the fronts from ``engine_main``).

An exception in a prefill fails that request only (a shared prefill call that raises at
launch is launched again one prompt at a time; one whose tokens cannot be read fails its
requests); one in a step fails the rows of that bucket's step (they shared it), never those
of other buckets, and the server lives on. After ``FAIL_AFTER`` failed steps in a row, or
any exception that escapes the loop, the device is taken as lost: every request held gets
``Failed`` and ``run`` raises ``EngineFailed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pipeline.contracts.bucket import Bucket
from pipeline.server.engine_calls import FAIL_AFTER as FAIL_AFTER
from pipeline.server.engine_calls import Calls, Launched, Resident, prefill_positions
from pipeline.server.jobs import Closed as Closed
from pipeline.server.jobs import EngineFailed as EngineFailed
from pipeline.server.jobs import (
    Event,
    Failed,
    Hooks,
    NoHooks,
    QueueFull,
    Request,
    first_tokens_first,
    put_events,
)
from pipeline.server.pacing import Pacer
from pipeline.server.placement import (
    BucketSlots,
    admission_order,
    passed_over,
    place,
    within_stall,
)

log = logging.getLogger("inf2_pipeline.serve")

IDLE_REPORT_S = 0.25  # an idle engine counts its wait as it passes, not when work comes


class Model(Protocol):
    """What the engine needs of ``pipeline.runtime.BucketedModel``."""

    eos_token_ids: tuple[int, ...]  # every id that ends an answer (none: only max_tokens)

    def slots(self, bucket: Bucket) -> Any: ...  # pipeline.runtime.runners.Slots


class Engine(Calls):
    def __init__(
        self,
        model: Model,
        buckets: Sequence[Bucket],
        loop: asyncio.AbstractEventLoop | None,
        *,
        max_queue: int,
        max_prefills: int = 4,
        spill: bool = True,
        overflow: bool = False,
        widest_from_idle: bool = False,
        prefill_merge: int = 0,
        prefill_costs: Mapping[Bucket, Callable[[int, int], float]] | None = None,
        fold: str = "auto",
        call_costs: Mapping[Bucket, Any] | None = None,
        prefill_stall: float | None = None,
        admit_order: str = "fcfs",
        batching: str = "iteration",
        overlap: bool = True,
        hooks: Hooks | None = None,
        deliver: Callable[[list[tuple[Request, Event]]], None] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        """``buckets``: the resident ones (loaded and warm). ``overlap``: launch each
        iteration's steps before reading the last one's tokens (where the slots can).
        ``prefill_costs``: each bucket's prefill calls' cost, to split prompts into calls by
        (``placement.cheapest_prefills``). ``fold``: how a prefill call rides in its
        bucket's step where the slots have mixed calls (``placement.FOLD``), ``auto`` by
        ``call_costs`` (each bucket's ``PrefillCosts``: ``fold_saving``).
        ``prefill_stall``: seconds an iteration's admissions may add to it (by ``call_costs``:
        their prefill calls, or the mixed call beyond the step for those folded), within
        ``max_prefills`` (``placement.within_stall``; None: the count alone).
        ``admit_order``: the order waiting requests are offered in (``placement.
        admission_order``: ``fcfs``, or ``shortest`` prompt first, none overtaken twice).
        ``deliver``: where each batch of events goes (default: the requests' queues, on
        ``loop``; the engine's own process sends them to the server's instead). ``pacer``:
        under overlap, hold each launch until the device's queued work is about to end
        (``pacing``; None: launch at once)."""
        self.model = model
        self.loop = loop
        if deliver is None:
            assert loop is not None, "an engine without deliver needs the event loop"

            def deliver(items: list[tuple[Request, Event]]) -> None:
                loop.call_soon_threadsafe(put_events, items)

        self._send = lambda out: deliver(first_tokens_first(out))
        self.max_queue = max_queue
        self.max_prefills = max_prefills
        self.spill = spill
        self.overflow = overflow
        self.widest_from_idle = widest_from_idle
        self.prefill_merge = prefill_merge
        self.prefill_costs = dict(prefill_costs or {})
        self.fold = fold
        self.call_costs = dict(call_costs or {})
        self.prefill_stall = prefill_stall
        admission_order([], [], admit_order)  # an unknown order fails here, not mid-serve
        self.admit_order = admit_order
        self.batching = batching
        self.overlap = overlap
        self.hooks: Any = hooks or NoHooks()
        self._pacer = pacer if overlap else None
        self._resident = [Resident(b, model.slots(b)) for b in sorted(buckets)]
        self._eos = frozenset(model.eos_token_ids)
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._failures = 0  # steps failed in a row
        self._broken = ""  # why the loop must stop (set by _failed)
        self._out: list[tuple[Request, Event]] = []
        self._inflight: list[Launched] = []  # steps launched, read at the next iteration
        # a bucket's prefill call that rides in its step this iteration: (length, items)
        self._folds: dict[Bucket, tuple[int, list[tuple[int, Request, int]]]] = {}
        self._no_fold: set[Bucket] = set()
        self._calls = {"prefill": 0.0, "step": 0.0}  # this iteration's model-call seconds
        self._said: set[tuple[Bucket, str, str]] = set()  # shared-call failures logged
        for r in self._resident:
            self.hooks.slots(r.bucket, 0)

    # --- the event loop's side: never blocks on the model ---------------------------------

    def submit(self, req: Request) -> None:
        if req.need > self.largest.seq:  # admission refuses these; never queue one
            raise ValueError(f"a request of {req.need} positions fits no resident bucket")
        with self._cond:
            if self._closing:
                raise Closed
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(req)
            self.hooks.queue_depth(len(self._queue))
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """The client is gone (or needs no more tokens): leave the queue, or free the slot
        at the next iteration."""
        req.cancelled = True
        with self._cond:
            if req in self._queue:
                self._queue.remove(req)
                self.hooks.queue_depth(len(self._queue))
            self._cond.notify()

    def close(self) -> None:
        """Take no new requests; ``run`` finishes what is queued and running, then returns."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def largest(self) -> Bucket:
        """The resident bucket with the longest sequence (then the largest batch)."""
        return max((r.bucket for r in self._resident), key=lambda b: (b.seq, b.batch))

    # --- the model thread ------------------------------------------------------------------

    def run(self) -> None:
        """The loop, until ``close`` and nothing is left. Raises ``EngineFailed`` (after
        failing every request it holds) when it cannot go on: the caller marks the server
        failed, so its readiness probe fails and the pod restarts."""
        try:
            self._loop()
        except Exception as e:
            self._fail_everything(f"the engine stopped: {type(e).__name__}: {e}")
            raise EngineFailed(str(e)) from e

    def _loop(self) -> None:
        clock = time.perf_counter
        while True:
            # this iteration's events: kept on self, so a failure mid-iteration still
            # delivers those already made (_fail_everything)
            out = self._out = []
            start = clock()
            self._calls["prefill"] = self._calls["step"] = 0.0
            self._retire_cancelled()
            with self._cond:
                waited = clock()
                if not self._queue and not self._running():
                    self.hooks.idle()
                while not self._queue and not self._running():
                    if self._closing:
                        return
                    if not self._cond.wait(IDLE_REPORT_S):  # still idle: counted as it passes
                        now = clock()
                        self.hooks.engine_time(now - waited, 0.0, 0.0, 0.0)
                        self.hooks.idle()
                        start, waited = start + now - waited, now
                self._hold()
                waited = clock() - waited
                admitted = self._take_admissions()
            launched_at = clock()
            if self._pacer is not None:
                late = self._pacer.launching(self._inflight)
                if late is not None:
                    self.hooks.launch(late, self._pacer.lead_s)
            prefills = self._launch_prefills(admitted, out) if admitted else []
            now = [c for c in prefills if not c.deferred]
            if now:
                # First tokens go out before the steps: a prefill's token does not wait
                # for every running bucket's next step.
                self._read_prefills(now, out)
                self._send(out)
                out = self._out = []
            steps = [c for res in self._resident for c in self._launch_step(res, out)]
            # A deferred call (``overlap``, slots that launch) is read only behind the next
            # calls: the last iteration's steps now, after this one's are queued, so the
            # device has work while the host delivers their tokens; this one's prefills
            # after that (their first tokens come before this iteration's step ends).
            for call in self._inflight:
                self._read_call(call, out)
            deferred = [c for c in prefills if c.deferred]
            if deferred and out:
                # The last steps' tokens go now: reading this iteration's prefills waits
                # for them to run, which would hold every running row's token back too.
                self._send(out)
                out = self._out = []
            self._read_prefills(deferred, out)
            for call in steps:
                if not call.deferred:
                    self._read_call(call, out)
            self._inflight = [c for c in steps if c.deferred]
            if self._pacer is not None:
                self._pacer.queued(self._inflight, launched_at)
            self._out = []
            if out:  # one wake-up of the loop per iteration, for every request
                self._send(out)
            # where the model thread's time went: waiting for work, inside the runner's
            # prefill and step calls, and the engine's own work around them
            pre, step = self._calls["prefill"], self._calls["step"]
            self.hooks.engine_time(waited, pre, step, clock() - start - waited - pre - step)
            if self._broken:
                raise EngineFailed(self._broken)

    def _hold(self) -> None:
        """Under the lock: wait for the pacer's launch time while the device still works on
        the last iteration's calls; requests that arrive meanwhile join this iteration."""
        while self._pacer is not None and self._inflight and not self._closing:
            until = self._pacer.until()
            left = None if until is None else until - time.perf_counter()
            if left is None or left <= 0:
                return
            self._cond.wait(min(left, 1.0))

    def _running(self) -> bool:
        return any(r.rows for r in self._resident)

    def _take_admissions(self) -> list[tuple[Request, Resident, int]]:
        """Place waiting requests (under the lock) and take them off the queue."""
        if not self._queue:
            return []
        queue = list(self._queue)  # oldest first
        waiting, order = queue, range(len(queue))  # fcfs: as it is, nobody to mark
        reordered = self.admit_order != "fcfs"
        if reordered:
            lengths, passed = [len(r.prompt) for r in queue], [r.passed_over for r in queue]
            order = admission_order(lengths, passed, self.admit_order)
            waiting = [queue[i] for i in order]
        state = [
            BucketSlots(
                r.bucket, [s for s in range(r.bucket.batch) if s not in r.rows], len(r.rows)
            )
            for r in self._resident
        ]
        placed = place(
            [q.need for q in waiting],
            state,
            max_prefills=self.max_prefills,
            spill=self.spill,
            batching=self.batching,
            overflow=self.overflow,
            widest_from_idle=self.widest_from_idle,
        )
        by_bucket = {r.bucket: r for r in self._resident}
        if self.prefill_stall is not None and len(placed) > 1:

            def stall(bucket: Bucket, chosen: list[int]) -> float:
                res = by_bucket[bucket]
                reqs = [waiting[placed[i].index] for i in chosen]
                return self._stall(
                    res, [(prefill_positions(res, len(r.prompt)), r, -1) for r in reqs]
                )

            keys = [p.bucket for p in placed]
            placed = placed[: within_stall(keys, stall, self.prefill_stall)]
        if reordered:  # who was overtaken goes first from now on
            for i in passed_over({order[p.index] for p in placed}, len(queue)):
                queue[i].passed_over = True
        now = time.monotonic()
        out = []
        for p in placed:
            req = waiting[p.index]
            self._queue.remove(req)
            self.hooks.admitted(req, now)
            out.append((req, by_bucket[p.bucket], p.slot))
        if out:
            self.hooks.queue_depth(len(self._queue))
        return out

    def _fail_everything(self, message: str) -> None:
        """Every request running or queued gets ``Failed`` (after the events this iteration
        had made); no new ones are taken."""
        out, self._out = self._out, []
        self._inflight = []
        self._folds.clear()
        for res in self._resident:
            out += [(req, Failed(message)) for req in res.rows.values()]
            res.rows.clear()
        with self._cond:
            self._closing = True
            out += [(req, Failed(message)) for req in self._queue]
            self._queue.clear()
        # a closed event loop raises RuntimeError: then nobody is waiting any more
        with contextlib.suppress(RuntimeError, OSError):  # OSError: the server's process
            self._send(out)

    def _retire_cancelled(self) -> None:
        for res in self._resident:
            for slot in [s for s, r in res.rows.items() if r.cancelled]:
                self._retire(res, slot, [], None)  # nobody is listening
