"""One compiled bucket ready to serve: its graphs, its own KV caches, greedy decoding, and
its rows as slots.

    session = DecodeSession(BucketGraphs(bucket_dir))
    session.generate([[1, 2, 3]], max_new_tokens=16)      # a whole batch, to the end
    first = session.prefill_slot(0, [1, 2, 3])            # or: one request per slot (serve)
    session.step([0])                                     # one token for each given slot

A greedy step is the decode graph (which also returns the argmax) plus three small updates
that feed it its own output: the next token becomes the input, the positions of the rows in
use advance by one (``live``: the others stay at 0, inside their own free rows), and the
token is written at its position into ``generated``, a [B, S+1] buffer of the session. So
generating N tokens is N calls of one step with no host work in between.

A step attends only the first S' cache positions, S' the shortest of ``spec.key_tiers`` that
holds every position in use (the host knows it), so decode in a long bucket costs what the
filled length costs.

On cuda that step is recorded as a CUDA graph (``pipeline.runtime.cuda_graphs``), one per
tier, all on the same input tensors, when the session is made: the caches are allocated here
and captured by address before any prefill has filled them, so the capture's warmup calls can
only overwrite zeros. Each token is then one replay; crossing a tier switches graphs with no
copy. Prefill calls of up to ``PREFILL_GRAPH_PROMPTS`` prompts and ``PREFILL_GRAPH_TOKENS``
positions are recorded too, one graph per prompt count and prefill length, sharing one memory
pool: a short prompt's prefill is a few hundred small kernels, whose launches cost more than
their work (a 256-token prefill took 3.2 ms launched one by one on an H200, the work about
1 ms). Longer ones run as ordinary calls, their launches hidden behind the work. The caches
are zeroed after every recording. CPU sessions run the same calls eagerly.

``generate`` syncs with the host only every ``EOS_CHECK_EVERY`` steps to see whether every
row has stopped, so the host queues replays ahead of the GPU instead of waiting on each
token. Rows keep running after their EOS; their extra tokens are cut off afterwards, so the
result equals stopping at once. The slot calls (``prefill_slot``, ``step``, ``free``: the
``Slots`` interface of ``pipeline.runtime.runners``) keep the step's inputs on the device:
a prefill writes its rows' first tokens and positions there, each step feeds its own output
on, and the host sends only the live mask when the rows stepped change. So ``launch`` and
``launch_prefill`` queue their work and return the tokens as ``Pending`` (read when the
server asks, ``pipeline.runtime.pending``): the server launches a step before it reads the
last one's tokens, and the device does not wait for the host in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from pipeline.runtime.cuda_graphs import Recorder, StaticGraph
from pipeline.runtime.graph_loading import BucketGraphs
from pipeline.runtime.pending import DeviceTokens, Pending, to_device
from pipeline.runtime.runners import until_eos
from pipeline.runtime.sampler_graph import RecordedSampler
from pipeline.runtime.sampling import Draws, SamplingParams, SlotSampling, draw

EOS_CHECK_EVERY = {"cpu": 1, "cuda": 8}  # steps between host syncs (cpu has nothing to queue)
# Prefill calls recorded as CUDA graphs: up to this many prompts (serve's --max-prefills
# default admits 4 per iteration) and this many positions in all (above it the work hides
# the launches, and each graph would hold more memory for nothing).
PREFILL_GRAPH_PROMPTS = 8
PREFILL_GRAPH_TOKENS = 4096

# Streaming: the tokens of one step, one per prompt; True stops generating.
OnTokens = Callable[[list[int]], bool | None]


class DecodeSession:
    def __init__(
        self,
        graphs: BucketGraphs,
        *,
        cuda_graphs: bool = True,
        recorder: Recorder | None = None,
        tiers: tuple[int, ...] | None = None,
    ) -> None:
        """``recorder`` overrides how the decode step is recorded (tests record on CPU);
        ``tiers`` the attended lengths (default ``spec.key_tiers``; the last must be seq)."""
        self.graphs = graphs
        self.spec = graphs.spec
        self.device = torch.device(graphs.device)
        self.k_cache, self.v_cache = graphs.new_cache()
        b, s, dev = self.spec.batch, self.spec.seq, self.device
        # generated[r, p]: the token this session produced for position p of row r (p = S
        # too: the last token of a full bucket needs no cache slot, only a place here)
        self.generated = torch.zeros((b, s + 1), dtype=torch.int64, device=dev)
        self.live = torch.zeros((b,), dtype=torch.int64, device=dev)  # 1: the row is in use
        self.tiers = tiers or self.spec.key_tiers
        if self.tiers[-1] != s or list(self.tiers) != sorted(set(self.tiers)):
            raise ValueError(f"tiers {self.tiers} must rise to the bucket length {s}")
        self._keys = {n: torch.arange(n, device=dev) for n in self.tiers}
        self._steps: dict[int, StaticGraph] = {}
        # The step's own input tensors (tokens [B, 1], positions [B]): the graphs' when
        # recorded, else plain tensors the eager step updates the same way.
        self._inputs: tuple[Tensor, Tensor] = (
            torch.zeros((b, 1), dtype=torch.int64, device=dev),
            torch.zeros((b,), dtype=torch.int64, device=dev),
        )
        if recorder is not None or (cuda_graphs and self.device.type == "cuda"):
            if recorder is None and not graphs.single_threaded:
                raise ValueError(
                    "CUDA graphs need packages loaded with BucketGraphs(..., single_threaded=True)"
                )
            inputs = None
            for n in self.tiers:
                step = StaticGraph(
                    self._greedy_step,
                    self._inputs,
                    self._fixed(n),
                    recorder=recorder,
                    inputs=inputs,
                )
                self._steps[n], inputs = step, step.inputs
            self._inputs = inputs  # type: ignore[assignment]
        self._prefills: dict[tuple[int, int], StaticGraph] = {}  # (prompts, length) -> graph
        if self._steps:
            self._record_prefills(recorder)
        # Slots. The step's inputs live on the device: a prefill writes its rows' first
        # tokens and positions there, and each step feeds its own output back, so no step
        # waits for the host. The host keeps the next position of each row in use (None:
        # free), a mirror of the positions the device holds for every row (None: unknown,
        # after a whole-batch call), and the rows the device's ``live`` marks.
        self._next: list[int | None] = [None] * b
        self._pos: list[int | None] = [0] * b
        self._live_rows: tuple[int, ...] | None = ()
        # Rows that sample (the others take the graph's argmax); graphed, their draw is
        # recorded too (``pipeline.runtime.sampler_graph``).
        self._sampling = SlotSampling()
        self._sampler = None
        if self._steps:
            self._sampler = RecordedSampler(self._inputs[0], recorder)
            argmax, logits = self._steps[self.tiers[-1]].outputs
            self._sampler.prepare(logits, argmax)

    @property
    def batch(self) -> int:
        return self.spec.batch

    @property
    def seq(self) -> int:
        return self.spec.seq

    @property
    def graphed(self) -> bool:
        return bool(self._steps)

    def tier(self, attended: int) -> int:
        """The shortest tier that holds ``attended`` cache positions."""
        return next((n for n in self.tiers if n >= attended), self.tiers[-1])

    # --- slots: one request per row, joining and leaving between steps --------------------

    def prefill_slot(self, slot: int, prompt: Sequence[int]) -> int:
        """Fill row ``slot`` with ``prompt`` (its other rows untouched); the first new token."""
        return self.prefill_slots([slot], [prompt])[0]

    def prefill_slots(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> list[int]:
        """Fill each of ``slots`` with its prompt, in one prefill call (at most
        ``spec.prefill_batch`` prompts): the first new token of each, greedy or drawn under
        its ``sampling`` params (which the slot keeps until it is freed)."""
        return self.launch_prefill(slots, prompts, sampling).tokens()

    def launch_prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> Pending:
        """``prefill_slots`` queued: the first tokens are written into the step's inputs on
        the device (a ``launch`` right after steps from them) and read when asked."""
        host = self.graphs.prefill_inputs(slots, [list(p) for p in prompts])
        params = list(sampling) if sampling is not None else [None] * len(slots)
        for slot, p in zip(slots, params, strict=True):
            self._sampling.assign(slot, p)
        sampled = set(self._sampling.sampled(slots))
        drawn = [i for i, s in enumerate(slots) if s in sampled]
        rows = self._sampling.draws([slots[i] for i in drawn], self.device) if drawn else None
        inputs = tuple(to_device(t, self.device) for t in host)
        graph = self._prefills.get(tuple(inputs[0].shape))
        if graph is not None:
            graph(*inputs)
            logits, nxt = graph.outputs
        else:
            logits, nxt = self.graphs.run_prefill(inputs, self.k_cache, self.v_cache)
        if rows is not None:
            nxt = _with_drawn(nxt, logits, to_device(torch.tensor(drawn), self.device), rows)
        where = inputs[2]
        self._inputs[0][:, 0].index_copy_(0, where, nxt)
        self._inputs[1].index_copy_(0, where, inputs[1])
        for slot, p in zip(slots, prompts, strict=True):
            self._next[slot] = self._pos[slot] = len(p)
        return DeviceTokens(nxt)

    # ``Slots`` names it ``prefill``; the batch ``prefill`` below (parity's) keeps its name.
    def step(self, slots: Sequence[int]) -> list[int]:
        """One step for each of ``slots``: the next token of each, in order."""
        return self.launch(slots).tokens()

    def launch(self, slots: Sequence[int]) -> Pending:
        """``step`` queued: the step's work goes to the device at once; its tokens are read
        when asked, so the host may launch the next step first (each feeds its own output
        to the next on the device)."""
        b, s = self.spec.batch, self.spec.seq
        order = tuple(slots)
        if not order or len(set(order)) != len(order):
            raise ValueError(f"step needs distinct slots in use, got {list(order)}")
        for r in order:
            pos = self._next[r] if 0 <= r < b else None
            if pos is None or pos >= s:
                raise ValueError(
                    f"slot {r} cannot step: "
                    + ("it is not in use" if pos is None else f"its {s} positions are full")
                )
        rows = tuple(sorted(order))
        # Rows not stepped keep their token and position (live 0): a row in use rewrites the
        # cache entry its next step would write, with the same values; a free row writes
        # inside its own row. A row whose position is past the cache (full, or unknown after
        # a whole-batch call) is parked at position 0 first, so no write falls outside.
        parked = [r for r in range(b) if r not in rows and _past(self._pos[r], s)]
        if parked:
            where = to_device(torch.tensor(parked), self.device)
            self._inputs[1].index_fill_(0, where, 0)
            self._inputs[0].index_fill_(0, where, 0)
            for r in parked:
                self._pos[r] = 0
        if self._live_rows != rows:
            live = torch.zeros((b,), dtype=torch.int64)
            live[list(rows)] = 1
            self.live.copy_(to_device(live, self.device))
            self._live_rows = rows
        held = [r for r in self.slots_in_use if r not in rows and self._next[r] < s]
        attended = max(self._next[r] for r in (*order, *held)) + 1  # type: ignore[operator]
        n = self.tier(attended)
        drawn = self._sampling.sampled(rows)
        taken = self._sampling.take(drawn)
        if self._steps:
            self._steps[n].replay()
            nxt, logits = self._steps[n].outputs
        else:
            nxt, logits = self._greedy_step(*self._inputs, *self._fixed(n))
        if drawn:  # the step fed its argmax back in: those rows get their drawn token instead
            nxt = self._draw(logits, nxt, drawn, taken)
        pending = DeviceTokens(nxt, order)  # copied before the next step overwrites it
        for r in rows:
            self._next[r] += 1  # type: ignore[operator]
            self._pos[r] += 1  # type: ignore[operator]
        return pending

    def _draw(
        self,
        logits: Tensor,
        nxt: Tensor,
        drawn: list[int],
        taken: list[tuple[SamplingParams, int]],
    ) -> Tensor:
        """The step's tokens with ``drawn``'s rows sampled, also fed to the next step: one
        recorded replay where the step is graphed, else the eager draw of those rows."""
        if self._sampler is not None:
            rows = [(r, p, i) for r, (p, i) in zip(drawn, taken, strict=True)]
            out = self._sampler(logits, nxt, rows)
            if out is not None:
                return out
        where = to_device(torch.tensor(drawn), self.device)
        params = Draws.of([p for p, _ in taken], [i for _, i in taken], self.device)
        nxt = _with_drawn(nxt, logits, where, params)
        self._inputs[0][where, 0] = nxt[where]
        return nxt

    def free(self, slot: int) -> None:
        """Row ``slot`` is no longer in use: its cache may be refilled by any prefill."""
        self._next[slot] = None
        self._sampling.free(slot)

    @property
    def slots_in_use(self) -> list[int]:
        return [r for r, pos in enumerate(self._next) if pos is not None]

    # --- whole batches: parity, BucketedModel.generate, benchmarks --------------------------

    def prefill(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B', S], lengths [B'] → fp32 logits [B', V] of each row's last real token;
        row r fills slot r."""
        return self._prefill_rows(tokens, lengths)[0]

    def decode(self, tokens: Tensor, positions: Tensor, attended: int | None = None) -> Tensor:
        """tokens [B, 1] at positions [B] → fp32 logits [B, V] (every row stepped).

        ``attended``: a bound on max(positions) + 1 when the caller knows one (else it is
        read from ``positions``, a host sync on cuda). With CUDA graphs the result is the
        graph's output buffer, overwritten by the next decode: clone it to keep it."""
        n = self.tier(attended if attended is not None else int(positions.max()) + 1)
        tokens, positions = _on(self.device, tokens, positions)
        self._mark_batch()
        if self._steps:
            self._steps[n](tokens, positions)
            return self._steps[n].outputs[1]
        return self.graphs.decode(tokens, positions, self.k_cache, self.v_cache, self._keys[n])[0]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
        on_tokens: OnTokens | None = None,
    ) -> list[list[int]]:
        """Greedy: the new tokens of each prompt, each ending at its first EOS (if any).

        ``on_tokens`` (for streaming): called after every step with the token each prompt's
        row produced (rows past their EOS included; the caller ignores them); returning True
        stops generating, and the result is cut there. Reading the tokens is a host sync per
        step, so it happens only when a callback is given: without one, the loop is the
        same as before (on cuda, a sync every ``EOS_CHECK_EVERY`` steps).
        """
        self._check(prompts, max_new_tokens)
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        tokens = torch.zeros((n, longest), dtype=torch.int64)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
        _, first = self._prefill_rows(tokens, torch.tensor([len(p) for p in prompts]))
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        self._load(first[:, None], lengths, n)
        step = self._advance()
        check_every = EOS_CHECK_EVERY.get(self.device.type, 8)
        done = 1  # tokens generated so far, per row
        stop = on_tokens is not None and bool(on_tokens(first.tolist()))
        while done < max_new_tokens and not stop:
            check = eos_token_id is not None and done % check_every == 0
            if check and self._all_stopped(lengths, done, n, eos_token_id):
                break
            step(longest + done)  # attends up to the last row's newest position
            done += 1
            if on_tokens is not None:
                stop = bool(on_tokens(self._column(lengths, done, n)))
        rows = self.generated[:n].tolist()
        starts = lengths.tolist()
        return [until_eos(r[p : p + done], eos_token_id) for r, p in zip(rows, starts, strict=True)]

    # --- the step and its state ---------------------------------------------------------------

    def _greedy_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        k: Tensor,
        v: Tensor,
        generated: Tensor,
        live: Tensor,
        keys: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Decode ``tokens`` at ``positions``, then feed the result back in, in place:
        (next tokens [B], logits [B, V])."""
        logits, nxt = self.graphs.decode(tokens, positions, k, v, keys)
        # The token is for the next position; clamped so a step past the end (which
        # callers never take) cannot index out of bounds inside a CUDA graph.
        where = (positions + 1).clamp(max=self.spec.seq)
        generated.scatter_(1, where[:, None], nxt[:, None])
        # rows not stepped (live 0) keep their token and position: a row held for a step
        # is fed the same token at the same place when it steps again
        tokens.copy_(torch.where(live[:, None] > 0, nxt[:, None], tokens))
        positions.add_(live)
        return nxt, logits

    def _prefill_rows(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Whole-batch prefill, row r into slot r; each row's first token goes into
        ``generated``. (logits [B', V], next tokens [B'])."""
        self._mark_batch()
        tokens, lengths = _on(self.device, tokens, lengths)
        logits, nxt = self.graphs.prefill_rows(tokens, lengths, self.k_cache, self.v_cache)
        self.generated[torch.arange(len(lengths), device=self.device), lengths] = nxt
        return logits, nxt

    def _record_prefills(self, recorder: Recorder | None) -> None:
        """One graph per (prompt count, prefill length) within the limits above. Their
        warmup calls write rows 0..P-1 of the caches, so the caches are zeroed after."""
        spec, dev = self.spec, self.device
        pool = torch.cuda.graph_pool_handle() if recorder is None else None
        for t in spec.prefill_lengths:
            for p in range(1, min(spec.prefill_batch, PREFILL_GRAPH_PROMPTS) + 1):
                if p * t > PREFILL_GRAPH_TOKENS:
                    break
                inputs = (
                    torch.zeros((p, t), dtype=torch.int64, device=dev),
                    torch.full((p,), t, dtype=torch.int64, device=dev),
                    torch.arange(p, dtype=torch.int64, device=dev),  # distinct rows
                )
                self._prefills[p, t] = StaticGraph(
                    self.graphs.prefills[t],
                    inputs,
                    (self.k_cache, self.v_cache),
                    recorder=recorder,
                    inputs=inputs,
                    pool=pool,
                )
        self.k_cache.zero_()
        self.v_cache.zero_()

    @property
    def prefill_graphs(self) -> list[tuple[int, int]]:
        """(prompts, length) of every prefill call recorded as a graph."""
        return sorted(self._prefills)

    def _fixed(self, n: int) -> tuple[Tensor, ...]:
        return (self.k_cache, self.v_cache, self.generated, self.live, self._keys[n])

    def _load(self, tokens: Tensor, positions: Tensor, rows: int) -> None:
        """The step's inputs for a batch in rows 0..rows-1 (the rest not in use)."""
        b = self.spec.batch
        self.live.copy_((torch.arange(b) < rows).to(torch.int64))
        self._inputs[0].zero_()
        self._inputs[1].zero_()
        self._inputs[0][:rows].copy_(tokens)
        self._inputs[1][:rows].copy_(positions)

    def _advance(self) -> Callable[[int], Any]:
        """A call that runs one greedy step from the loaded inputs, given how many cache
        positions it attends."""
        if self._steps:
            return lambda attended: self._steps[self.tier(attended)].replay()
        return lambda attended: self._greedy_step(*self._inputs, *self._fixed(self.tier(attended)))

    def _mark_batch(self) -> None:
        """Whole-batch calls take every row: no slot survives them, and they leave the step's
        inputs as they please."""
        if any(pos is not None for pos in self._next):
            raise RuntimeError("this bucket's slots are in use: free them before a batch call")
        self._pos = [None] * self.spec.batch
        self._live_rows = None

    def _column(self, lengths: Tensor, done: int, n: int) -> list[int]:
        """The token each of the first ``n`` rows produced at its step ``done``."""
        where = (lengths[:n] + done - 1).clamp(max=self.spec.seq)
        return self.generated[:n].gather(1, where[:, None]).squeeze(1).tolist()

    def _all_stopped(self, lengths: Tensor, done: int, n: int, eos: int) -> bool:
        cols = torch.arange(self.spec.seq + 1, device=self.device)
        mine = (cols >= lengths[:n, None]) & (cols < lengths[:n, None] + done)
        return bool(((self.generated[:n] == eos) & mine).any(1).all())

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not 1 <= len(prompts) <= self.spec.batch:
            raise ValueError(f"{len(prompts)} prompts for a bucket of batch {self.spec.batch}")
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) < 1 or longest + max_new_tokens - 1 > self.spec.seq:
            raise ValueError(
                f"prompts of 1..{self.spec.seq} tokens plus {max_new_tokens} new tokens must "
                f"fit {self.spec.seq} cache positions (longest prompt: {longest})"
            )


def _with_drawn(nxt: Tensor, logits: Tensor, rows: Tensor, draws: Draws) -> Tensor:
    """``nxt`` (a call's argmax tokens) with ``rows`` drawn from their logits instead."""
    out = nxt.clone()
    out[rows] = draw(logits[rows], draws)
    return out


def _past(position: int | None, seq: int) -> bool:
    """A device position that a step would write outside the cache at (None: unknown)."""
    return position is None or position >= seq


def _on(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    # The packages assume dense row-major inputs: a column slice is not.
    return tuple(t.to(device).contiguous() for t in tensors)
