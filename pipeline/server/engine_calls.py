"""The engine's calls on its buckets' slots: prefills, steps and mixed calls (a step with a
prefill call folded into it), launched and read back (``Calls``, which ``Engine`` runs).

Launching: where the slots have mixed calls and the bucket steps this iteration, an
iteration's admitted prompts of one bucket may ride in the step, packed into one stream
(``placement.fold_prompts``; by the start-up timings, ``serve --fold-prompts``), so they
cost no pass over the weights of their own; the rest go into prefill calls
(``placement.prefill_calls``). A shared prefill call that raises at launch runs again one
prompt a call, and a mixed call that raises before it runs runs again as its prefill and the
step apart (its bucket then folds no more), so only the culprit fails; one that ran and then
failed (``RanThenFailed``) fails the rows it held.

Reading: a call's tokens go to the rows it held that are still its requests' (``Launched.
theirs``): first tokens to its prompts, next tokens to its step's rows. A prefill whose
tokens cannot be read fails its requests; a step or mixed call fails every row it held
(they shared it) and counts towards the engine's ``FAIL_AFTER``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.contracts.bucket import Bucket, mixed_length
from pipeline.runtime.pending import Pending, RanThenFailed, Ready
from pipeline.server.jobs import Event, Failed, Finished, Request, Tokens, sampling_args
from pipeline.server.placement import fold_prompts, prefill_calls

log = logging.getLogger("inf2_pipeline.serve")

FAIL_AFTER = 3  # steps failed in a row (any bucket) after which the device is taken as lost


@dataclass
class Resident:
    """A resident bucket: its slots, and the request each busy slot holds."""

    bucket: Bucket
    slots: Any  # Slots
    rows: dict[int, Request] = field(default_factory=dict)  # slot -> its request


@dataclass
class Launched:
    """A prefill, step or mixed call (a step with prompts in it) launched on a bucket's
    slots, its tokens not read yet."""

    res: Resident
    rows: list[tuple[int, Request]]  # (slot, its request) in the call's order
    pending: Pending
    # positions per prompt of a prefill call's prompts; a mixed call's stream, all its prompts
    computed: int = 0
    deferred: bool = False  # read at the engine's next chance, not at once
    prompts: int = 0  # its last rows that are prompts: all of a prefill's, none of a step's

    @property
    def prefill(self) -> bool:
        return self.prompts == len(self.rows)

    def theirs(self) -> list[tuple[int, Request]]:
        """The rows still held by the request they were launched for (a row retired since,
        whose slot may already hold another request, gets nothing of this call)."""
        return [(s, r) for s, r in self.rows if self.res.rows.get(s) is r]


class Calls:
    """The launching and reading half of ``Engine``, and what it does with a row's tokens and
    failures; ``Engine`` (the loop around it) sets what is declared here."""

    hooks: Any
    overlap: bool
    batching: str
    max_prefills: int
    prefill_merge: int
    prefill_costs: dict[Bucket, Any]
    fold: str
    call_costs: dict[Bucket, Any]
    _resident: list[Resident]
    _folds: dict[Bucket, tuple[int, list[tuple[int, Request, int]]]]
    _no_fold: set[Bucket]  # buckets whose mixed call failed at launch: they fold no more
    _said: set[tuple[Any, ...]]
    _failures: int  # steps failed in a row
    _broken: str  # why the loop must stop (set by _failed)
    _eos: frozenset[int]
    _calls: dict[str, float]  # this iteration's seconds inside the runner's calls, by part
    _pacer: Any  # pacing.Pacer, or None

    @contextlib.contextmanager
    def _timed(self, part: str) -> Any:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._calls[part] += time.perf_counter() - t

    def _step_failed(
        self,
        res: Resident,
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
        self, res: Resident, slot: int, token: int, out: list[tuple[Request, Event]]
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
        self, res: Resident, slot: int, out: list[tuple[Request, Event]], event: Event | None
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

    def _launch_prefills(
        self, admitted: list[tuple[Request, Resident, int]], out: list[tuple[Request, Event]]
    ) -> list[Launched]:
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
            fold, apart = self._plan(res, admitted_here)
            if fold is not None:  # launched with the bucket's step (_launch_step)
                self._folds[bucket] = fold
            for computed, items in apart:
                calls += self._launch_group(res, computed, items, out)
            self.hooks.slots(bucket, len(res.rows))
        return calls

    def _launch_group(
        self,
        res: Resident,
        computed: int,
        items: list[tuple[int, Request, int]],
        out: list[tuple[Request, Event]],
    ) -> list[Launched]:
        """One prefill call of ``items`` (each: its own prefill length, request, slot) at
        ``computed`` positions; where a shared call raises at launch, one call a prompt."""
        part = [(slot, req) for _, req, slot in items]
        if len(part) > 1:
            try:
                return [self._launch_prefill(res, part, computed)]
            except Exception as e:  # again one prompt a call: said once per cause
                self._shared_failed(res.bucket, len(part), e)
        calls = []
        for own, req, slot in items:
            try:
                calls.append(self._launch_prefill(res, [(slot, req)], own))
            except Exception as e:  # this request fails; the others go on
                self._retire(res, slot, out, Failed(f"{type(e).__name__}: {e}"))
        return calls

    def _fold_choice(
        self,
        res: Resident,
        items: list[tuple[int, Request, int]],
        size: int,
        cost: Any,
    ) -> tuple[int, list[tuple[int, Request, int]]] | None:
        """Which of a bucket's admitted prompts (each as its prefill length, request, slot)
        ride in its step, packed into one mixed call (``placement.fold_prompts``), and the
        stream's length: where the slots have mixed calls and the bucket steps this
        iteration (rows running, or prompts left to prefill apart that want more than one
        token), and with ``auto`` where
        the start-up costs say the mixed call costs less than the prefill calls those
        prompts would take and the step apart."""
        lengths = getattr(res.slots, "mixed_lengths", ())
        if self.fold == "off" or not lengths or not hasattr(res.slots, "launch_mixed"):
            return None
        if self.batching == "static" or res.bucket in self._no_fold:  # the baseline; a failure
            return None
        most = min(int(getattr(res.slots, "mixed_batch", 0)), self.max_prefills)
        chosen = fold_prompts(
            [len(r.prompt) for _, r, _ in items], max(lengths), most, res.bucket.seq
        )
        running = any(0 < r.launched < r.max_tokens for r in res.rows.values())
        # a prompt prefilled apart steps this iteration only if it wants a second token
        folded = set(chosen)
        apart = [r for i, (_, r, _) in enumerate(items) if i not in folded]
        if not chosen or not (running or any(r.max_tokens > 1 for r in apart)):
            return None
        picked = [items[i] for i in chosen]
        stream = mixed_length(lengths, sum(len(r.prompt) for _, r, _ in picked))
        if self.fold == "auto":
            costs = self.call_costs.get(res.bucket)
            if costs is None or not costs.mixed:
                return None
            calls = prefill_calls(picked, size, self.prefill_merge, cost)
            apart = sum(costs(len(group), length) for length, group in calls)
            if costs.fold_saving(apart, stream) <= 0:
                return None
        return stream, picked

    def _plan(
        self, res: Resident, items: list[tuple[int, Request, int]]
    ) -> tuple[
        tuple[int, list[tuple[int, Request, int]]] | None,
        list[tuple[int, list[tuple[int, Request, int]]]],
    ]:
        """How a bucket's admitted prompts (each as its prefill length, request, slot) are
        launched: those folded into its step (``_fold_choice``: the stream's length and
        them; None: none), and the others' prefill calls (``placement.prefill_calls``)."""
        fold = self._fold_choice(res, items, call_size(res), self.prefill_costs.get(res.bucket))
        if fold is not None:
            folded = {id(r) for _, r, _ in fold[1]}
            items = [it for it in items if id(it[1]) not in folded]
        return fold, self._apart(res, items)

    def _apart(
        self, res: Resident, items: list[tuple[int, Request, int]]
    ) -> list[tuple[int, list[tuple[int, Request, int]]]]:
        """The prefill calls of prompts prefilled apart (``placement.prefill_calls``)."""
        cost = self.prefill_costs.get(res.bucket)
        return prefill_calls(items, call_size(res), self.prefill_merge, cost)

    def _stall(self, res: Resident, items: list[tuple[int, Request, int]]) -> float:
        """Seconds a bucket's admissions (each as its prefill length, request, slot) add to
        the iteration, launched as ``_plan`` says, by the start-up timings: the prompts
        folded into the step cost the mixed call beyond the step, the others their prefill
        calls (``--prefill-stall``); 0 where the bucket has no timings."""
        costs = self.call_costs.get(res.bucket)
        if costs is None:
            return 0.0
        fold, calls = self._plan(res, items)
        mixed = None if fold is None else costs.mixed_call(fold[0])
        if fold is not None and mixed is None:  # not timed: every prompt as prefill calls
            calls = self._apart(res, items)
        seconds = 0.0 if mixed is None else max(0.0, mixed - costs.step)  # timings are noisy
        return seconds + sum(costs(len(group), length) for length, group in calls)

    def _shared_failed(self, bucket: Bucket, prompts: int, e: Exception) -> None:
        """Logged once per bucket and cause: a systematic failure would otherwise show only as
        slower prefills (on cuda, calls of more prompts than were graphed did, to 2026-12-04)."""
        cause = (bucket, type(e).__name__, str(e)[:200])
        if cause not in self._said:
            self._said.add(cause)
            msg = "a prefill call of %d prompts in %s failed (%s: %s); one a call (said once)"
            log.warning(msg, prompts, bucket.name, type(e).__name__, e)

    def _launch_prefill(
        self, res: Resident, rows: list[tuple[int, Request]], computed: int
    ) -> Launched:
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
        return Launched(res, rows, pending, computed, launch is not None, len(rows))

    def _read_prefills(self, calls: list[Launched], out: list[tuple[Request, Event]]) -> None:
        for call in calls:
            self._read_call(call, out)

    def _launch_step(self, res: Resident, out: list[tuple[Request, Event]]) -> list[Launched]:
        """One step of the bucket's rows that still have tokens to launch (a row whose last
        token is launched but not read waits for it; one that ended at a step not yet read
        is stepped once more, and that token is dropped), with this iteration's folded
        prefill call in it where there is one: a mixed call. A mixed call that raises before
        it runs is run again as its prefill and the step apart, so only a culprit fails, and
        the bucket folds no more (a failure that would repeat every iteration); one that ran
        and then failed (``RanThenFailed``) fails every row it held, as a step does."""
        fold = self._folds.pop(res.bucket, None)
        folded = {slot for _, _, slot in fold[1]} if fold else set()
        rows = [
            (s, r)
            for s, r in sorted(res.rows.items())
            if r.launched < r.max_tokens and s not in folded
        ]
        calls: list[Launched] = []
        if fold is not None:
            if rows:
                try:
                    return [self._launch_mixed(res, rows, *fold)]
                except RanThenFailed as e:
                    held = [*rows, *((slot, req) for _, req, slot in fold[1])]
                    self._step_failed(res, held, e, out)
                    return []
                except Exception as e:
                    self._no_fold.add(res.bucket)
                    msg = "a step with %d prompts in %s failed (%s: %s); it folds no more"
                    log.warning(msg, len(fold[1]), res.bucket.name, type(e).__name__, e)
            # apart, in one prefill call at the longest of their prefill lengths
            calls = self._launch_group(res, max(it[0] for it in fold[1]), fold[1], out)
        if not rows:
            return calls
        slots = [s for s, _ in rows]
        launch = getattr(res.slots, "launch", None) if self.overlap else None
        try:
            with self._timed("step"):
                pending = launch(slots) if launch is not None else Ready(res.slots.step(slots))
        except Exception as e:  # the rows of this step fail together: they shared it
            self._step_failed(res, rows, e, out)
            return calls
        for _, r in rows:
            r.launched += 1
        return [*calls, Launched(res, rows, pending, deferred=launch is not None)]

    def _launch_mixed(
        self,
        res: Resident,
        rows: list[tuple[int, Request]],
        computed: int,
        items: list[tuple[int, Request, int]],
    ) -> Launched:
        reqs = [req for _, req, _ in items]
        prompts = [(slot, req) for _, req, slot in items]
        with self._timed("step"):  # read by _read_call, at once or (overlap) next iteration
            pending = res.slots.launch_mixed(
                [s for s, _ in rows],
                [slot for slot, _ in prompts],
                [r.prompt for r in reqs],
                *sampling_args(reqs),
            )
        for _, r in rows:
            r.launched += 1
        for r in reqs:
            r.launched = 1
        return Launched(res, [*rows, *prompts], pending, computed, self.overlap, len(prompts))

    def _read_call(self, call: Launched, out: list[tuple[Request, Event]]) -> None:
        """A call's tokens to its rows: first tokens to its prompts, next tokens to its
        step's rows. A prefill that fails fails its requests; a step or mixed call that
        fails fails every row it held (they shared it) and counts towards ``FAIL_AFTER``."""
        res = call.res
        try:
            got = self._read(call, "prefill" if call.prefill else "step")
        except Exception as e:
            if not call.prefill:
                self._step_failed(res, call.theirs(), e, out)
                return
            for slot, _ in call.theirs():  # their rows were computed
                self._retire(res, slot, out, Failed(f"{type(e).__name__}: {e}"))
            return
        prompts = [r for _, r in call.rows[len(call.rows) - call.prompts :]]
        firsts = {id(r) for r in prompts}
        # a mixed call's stream padding is counted with its first prompt
        padding = 0 if call.prefill else call.computed - sum(len(r.prompt) for r in prompts)
        stepped = 0
        for slot, req, token in got:
            if id(req) in firsts:
                computed = call.computed if call.prefill else len(req.prompt) + padding
                padding = 0
                self.hooks.prefill(res.bucket, len(req.prompt), computed, not call.prefill)
            else:
                stepped += 1
            self._deliver_token(res, slot, token, out)
        if not call.prefill:
            self._failures = 0
            self.hooks.step(res.bucket, stepped)
        self.hooks.slots(res.bucket, len(res.rows))

    def _read(self, call: Launched, part: str) -> list[tuple[int, Request, int]]:
        """The call's tokens (the host sync, timed as ``part``), as (slot, request, token)
        for the rows still held by their request; raises what reading raised."""
        with self._timed(part):
            pending = call.pending
            pacer = self._pacer
            tokens = pending.tokens() if pacer is None else pacer.read(pending, pending.tokens)
        if len(tokens) != len(call.rows):
            raise RuntimeError(f"{len(tokens)} tokens for {len(call.rows)} rows")
        mine = {id(r) for _, r in call.theirs()}
        return [(s, r, t) for (s, r), t in zip(call.rows, tokens, strict=True) if id(r) in mine]


def call_size(res: Resident) -> int:
    """The most prompts one prefill call of the bucket's slots takes."""
    shared = hasattr(res.slots, "launch_prefill") or hasattr(res.slots, "prefill_many")
    return int(getattr(res.slots, "prefill_batch", 1)) if shared else 1


def prefill_positions(res: Resident, n: int) -> int:
    """Positions a prefill of n tokens computes in this bucket: the prefill length the slots
    say they use (cpu/cuda: the shortest prefill graph that holds n), else the bucket's."""
    positions = getattr(res.slots, "prefill_positions", None)
    return int(positions(n)) if positions is not None else res.bucket.seq
