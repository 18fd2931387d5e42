"""The serving loop: iteration-level batching over the resident buckets' slots.

The asyncio side ``submit``s requests (never blocking: a short lock, no model work); one
model thread (``run``) loops, because a runner is not re-entrant. Every iteration:

1. retires rows whose client left (or whose stop string matched), freeing their slots;
2. admits waiting requests into free slots (``placement.place``: first come, first served,
   at most ``max_prefills``) and launches their prefills (``placement.prefill_calls``);
3. launches one decode step for every bucket with rows that have tokens to launch;
4. reads tokens and delivers each row's: with ``overlap`` (slots that ``launch``: cpu/cuda)
   the previous iteration's steps first, which the device finished while this iteration's
   calls queued behind them, then this iteration's prefills, whose steps are read at the
   next iteration; otherwise (neuron, or ``overlap=False``) the prefills before step 3 and
   the steps right after it;
5. retires each row the moment its end is read (EOS, its own ``max_tokens``), so the slot
   is free for the next iteration's admissions. Under overlap a row that ended at EOS was
   already launched once more: that token is dropped (``_Call.theirs``). A row whose last
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
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.contracts.bucket import Bucket
from pipeline.runtime.pending import Pending, Ready
from pipeline.server.jobs import Closed as Closed
from pipeline.server.jobs import EngineFailed as EngineFailed
from pipeline.server.jobs import (
    Event,
    Failed,
    Finished,
    Hooks,
    NoHooks,
    QueueFull,
    Request,
    Tokens,
    put_events,
    sampling_args,
)
from pipeline.server.placement import BucketSlots, place, prefill_calls

log = logging.getLogger("inf2_pipeline.serve")

FAIL_AFTER = 3  # steps failed in a row (any bucket) after which the device is taken as lost
IDLE_REPORT_S = 0.25  # an idle engine counts its wait as it passes, not when work comes


class Model(Protocol):
    """What the engine needs of ``pipeline.runtime.BucketedModel``."""

    eos_token_ids: tuple[int, ...]  # every id that ends an answer (none: only max_tokens)

    def slots(self, bucket: Bucket) -> Any: ...  # pipeline.runtime.runners.Slots


@dataclass
class _Resident:
    bucket: Bucket
    slots: Any  # Slots
    rows: dict[int, Request] = field(default_factory=dict)  # slot -> its request


@dataclass
class _Call:
    """A prefill or step launched on a bucket's slots, its tokens not read yet."""

    res: _Resident
    rows: list[tuple[int, Request]]  # (slot, its request) in the call's order
    pending: Pending
    computed: int = 0  # a prefill's positions per prompt (0: a step)
    deferred: bool = False  # read at the engine's next chance, not at once

    def theirs(self) -> list[tuple[int, Request]]:
        """The rows still held by the request they were launched for (a row retired since,
        whose slot may already hold another request, gets nothing of this call)."""
        return [(s, r) for s, r in self.rows if self.res.rows.get(s) is r]


class Engine:
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
        batching: str = "iteration",
        overlap: bool = True,
        hooks: Hooks | None = None,
        deliver: Callable[[list[tuple[Request, Event]]], None] | None = None,
    ) -> None:
        """``buckets``: the resident ones (loaded and warm). ``overlap``: launch each
        iteration's steps before reading the last one's tokens (where the slots can).
        ``deliver``: where each batch of events goes (default: the requests' queues, on
        ``loop``; the engine's own process sends them to the server's instead)."""
        self.model = model
        self.loop = loop
        if deliver is None:
            assert loop is not None, "an engine without deliver needs the event loop"

            def deliver(items: list[tuple[Request, Event]]) -> None:
                loop.call_soon_threadsafe(put_events, items)

        self._send = deliver
        self.max_queue = max_queue
        self.max_prefills = max_prefills
        self.spill = spill
        self.overflow = overflow
        self.widest_from_idle = widest_from_idle
        self.prefill_merge = prefill_merge
        self.prefill_costs = dict(prefill_costs or {})
        self.batching = batching
        self.overlap = overlap
        self.hooks: Any = hooks or NoHooks()
        self._resident = [_Resident(b, model.slots(b)) for b in sorted(buckets)]
        self._eos = frozenset(model.eos_token_ids)
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._failures = 0  # steps failed in a row
        self._broken = ""  # why the loop must stop (set by _failed)
        self._out: list[tuple[Request, Event]] = []
        self._inflight: list[_Call] = []  # steps launched, read at the next iteration
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
                waited = clock() - waited
                admitted = self._take_admissions()
            prefills = self._launch_prefills(admitted, out) if admitted else []
            now = [c for c in prefills if not c.deferred]
            if now:
                # First tokens go out before the steps: a prefill's token does not wait
                # for every running bucket's next step.
                self._read_prefills(now, out)
                self._send(out)
                out = self._out = []
            steps = [c for res in self._resident if (c := self._launch_step(res, out))]
            # A deferred call (``overlap``, slots that launch) is read only behind the next
            # calls: the last iteration's steps now, after this one's are queued, so the
            # device has work while the host delivers their tokens; this one's prefills
            # after that (their first tokens come before this iteration's step ends).
            for call in self._inflight:
                self._read_step(call, out)
            self._read_prefills([c for c in prefills if c.deferred], out)
            for call in steps:
                if not call.deferred:
                    self._read_step(call, out)
            self._inflight = [c for c in steps if c.deferred]
            self._out = []
            if out:  # one wake-up of the loop per iteration, for every request
                self._send(out)
            # where the model thread's time went: waiting for work, inside the runner's
            # prefill and step calls, and the engine's own work around them
            pre, step = self._calls["prefill"], self._calls["step"]
            self.hooks.engine_time(waited, pre, step, clock() - start - waited - pre - step)
            if self._broken:
                raise EngineFailed(self._broken)

    @contextlib.contextmanager
    def _timed(self, part: str) -> Any:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._calls[part] += time.perf_counter() - t

    def _running(self) -> bool:
        return any(r.rows for r in self._resident)

    def _take_admissions(self) -> list[tuple[Request, _Resident, int]]:
        """Place waiting requests (under the lock) and take them off the queue."""
        if not self._queue:
            return []
        waiting = list(self._queue)
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

    def _launch_prefills(
        self, admitted: list[tuple[Request, _Resident, int]], out: list[tuple[Request, Event]]
    ) -> list[_Call]:
        """Launch prefills of what was admitted: requests of one bucket and one prefill length
        share a call where the slots take several (``prefill_many``), else one call each; a
        shared call that raises is launched again one prompt at a time, so only the culprit
        fails. ``prefill_merge`` and a bucket's measured ``prefill_costs`` say which prompts
        share a call (``placement.prefill_calls``)."""
        per_bucket: dict[Bucket, list[tuple[int, Request, int]]] = {}
        for req, res, slot in admitted:
            res.rows[slot] = req
            length = prefill_positions(res, len(req.prompt))
            per_bucket.setdefault(res.bucket, []).append((length, req, slot))
        by_bucket = {r.bucket: r for r in self._resident}
        calls = []
        for bucket, admitted_here in per_bucket.items():
            res = by_bucket[bucket]
            shared = hasattr(res.slots, "launch_prefill") or hasattr(res.slots, "prefill_many")
            size = int(getattr(res.slots, "prefill_batch", 1)) if shared else 1
            cost = self.prefill_costs.get(bucket)
            for computed, items in prefill_calls(admitted_here, size, self.prefill_merge, cost):
                part = [(slot, req) for _, req, slot in items]
                call = None
                if len(part) > 1:
                    try:
                        call = self._launch_prefill(res, part, computed)
                    except Exception as e:  # again one prompt a call: said once per cause
                        self._shared_failed(bucket, len(part), e)
                if call is not None:
                    calls.append(call)
                    continue
                for own, req, slot in items:
                    try:
                        calls.append(self._launch_prefill(res, [(slot, req)], own))
                    except Exception as e:  # this request fails; the others go on
                        self._retire(res, slot, out, Failed(f"{type(e).__name__}: {e}"))
            self.hooks.slots(bucket, len(res.rows))
        return calls

    def _shared_failed(self, bucket: Bucket, prompts: int, e: Exception) -> None:
        """Logged once per bucket and cause: a systematic failure would otherwise show only as
        slower prefills (on cuda, calls of more prompts than were graphed did, to 2026-12-04)."""
        cause = (bucket, type(e).__name__, str(e)[:200])
        if cause not in self._said:
            self._said.add(cause)
            msg = "a prefill call of %d prompts in %s failed (%s: %s); one a call (said once)"
            log.warning(msg, prompts, bucket.name, type(e).__name__, e)

    def _launch_prefill(
        self, res: _Resident, rows: list[tuple[int, Request]], computed: int
    ) -> _Call:
        slots, reqs = [s for s, _ in rows], [r for _, r in rows]
        prompts = [r.prompt for r in reqs]
        sampling = sampling_args(reqs)
        launch = getattr(res.slots, "launch_prefill", None) if self.overlap else None
        with self._timed("prefill"):
            if launch is not None:
                pending = launch(slots, prompts, *sampling)
            elif len(rows) > 1:
                pending = Ready(res.slots.prefill_many(slots, prompts, *sampling))
            else:
                one = (sampling[0][0],) if sampling else ()
                pending = Ready([res.slots.prefill(slots[0], prompts[0], *one)])
        for r in reqs:
            r.launched = 1
        return _Call(res, rows, pending, computed, deferred=launch is not None)

    def _read_prefills(self, calls: list[_Call], out: list[tuple[Request, Event]]) -> None:
        for call in calls:
            res = call.res
            try:
                got = self._read(call, "prefill")
            except Exception as e:  # the call's requests fail: their rows were computed
                for slot, _ in call.theirs():
                    self._retire(res, slot, out, Failed(f"{type(e).__name__}: {e}"))
                continue
            for slot, req, token in got:
                self.hooks.prefill(res.bucket, len(req.prompt), call.computed)
                self._deliver_token(res, slot, token, out)
            self.hooks.slots(res.bucket, len(res.rows))

    def _launch_step(self, res: _Resident, out: list[tuple[Request, Event]]) -> _Call | None:
        """One step of the bucket's rows that still have tokens to launch (a row whose last
        token is launched but not read waits for it; one that ended at a step not yet read
        is stepped once more, and that token is dropped)."""
        rows = [(s, r) for s, r in sorted(res.rows.items()) if r.launched < r.max_tokens]
        if not rows:
            return None
        slots = [s for s, _ in rows]
        launch = getattr(res.slots, "launch", None) if self.overlap else None
        try:
            with self._timed("step"):
                pending = launch(slots) if launch is not None else Ready(res.slots.step(slots))
        except Exception as e:  # the rows of this step fail together: they shared it
            self._step_failed(res, rows, e, out)
            return None
        for _, r in rows:
            r.launched += 1
        return _Call(res, rows, pending, deferred=launch is not None)

    def _read_step(self, call: _Call, out: list[tuple[Request, Event]]) -> None:
        res = call.res
        try:
            got = self._read(call, "step")
        except Exception as e:
            self._step_failed(res, call.theirs(), e, out)
            return
        self._failures = 0
        for slot, _, token in got:
            self._deliver_token(res, slot, token, out)
        self.hooks.step(res.bucket, len(got))
        self.hooks.slots(res.bucket, len(res.rows))

    def _read(self, call: _Call, part: str) -> list[tuple[int, Request, int]]:
        """The call's tokens (the host sync, timed as ``part``), as (slot, request, token)
        for the rows still held by their request; raises what reading raised."""
        with self._timed(part):
            tokens = call.pending.tokens()
        if len(tokens) != len(call.rows):
            raise RuntimeError(f"{len(tokens)} tokens for {len(call.rows)} rows")
        mine = {id(r) for _, r in call.theirs()}
        return [(s, r, t) for (s, r), t in zip(call.rows, tokens, strict=True) if id(r) in mine]

    def _step_failed(
        self,
        res: _Resident,
        rows: list[tuple[int, Request]],
        e: Exception,
        out: list[tuple[Request, Event]],
    ) -> None:
        message = f"{type(e).__name__}: {e}"
        for slot, req in rows:
            if res.rows.get(slot) is req:
                self._retire(res, slot, out, Failed(message))
        self._failed(res.bucket, message)

    def _deliver_token(
        self, res: _Resident, slot: int, token: int, out: list[tuple[Request, Event]]
    ) -> None:
        req = res.rows[slot]
        now = time.monotonic()
        req.produced += 1
        self.hooks.token(req, now)
        req.last_token = now
        out.append((req, Tokens([int(token)])))
        if token in self._eos:
            self._retire(res, slot, out, Finished("stop"))
        elif req.produced >= req.max_tokens:
            self._retire(res, slot, out, Finished("length"))

    def _retire(
        self, res: _Resident, slot: int, out: list[tuple[Request, Event]], event: Event | None
    ) -> None:
        """The row is done: its event goes out whatever ``free`` does (a free that fails
        leaves the slot with the engine's bookkeeping, never the request hanging)."""
        req = res.rows.pop(slot)
        if event is not None:
            out.append((req, event))
        try:
            res.slots.free(slot)
        except Exception as e:
            log.warning("freeing slot %d of %s: %s: %s", slot, res.bucket.name, type(e).__name__, e)
        self.hooks.slots(res.bucket, len(res.rows))

    def _failed(self, bucket: Bucket, message: str) -> None:
        """A step failed: after ``FAIL_AFTER`` in a row the device is taken as lost, and the
        loop stops at the end of this iteration."""
        self._failures += 1
        if self._failures >= FAIL_AFTER:
            self._broken = f"{self._failures} steps failed in a row ({bucket.name}: {message})"

    def _fail_everything(self, message: str) -> None:
        """Every request running or queued gets ``Failed`` (after the events this iteration
        had made); no new ones are taken."""
        out, self._out = self._out, []
        self._inflight = []
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


def prefill_positions(res: _Resident, n: int) -> int:
    """Positions a prefill of n tokens computes in this bucket: the prefill length the slots
    say they use (cpu/cuda: the shortest prefill graph that holds n), else the bucket's."""
    positions = getattr(res.slots, "prefill_positions", None)
    return int(positions(n)) if positions is not None else res.bucket.seq
