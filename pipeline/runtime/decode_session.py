"""One compiled bucket ready to run: its graphs, its own KV caches and step inputs, the calls
recorded on them, and greedy decoding of whole batches.

    session = DecodeSession(BucketGraphs(bucket_dir))
    session.generate([[1, 2, 3]], max_new_tokens=16)      # a whole batch, to the end
    slots = SessionSlots(session)                          # or: one request per row (serve;
    slots.prefill(0, [1, 2, 3]); slots.step([0])           # pipeline.runtime.session_slots)

A greedy step is the decode graph (which also returns the argmax) plus three small updates
that feed it its own output: the next token becomes the input, the positions of the rows in
use advance by one (``live``: the others keep theirs, inside their own rows), and the token
is written at its position into ``generated``, a [B, S+1] buffer of the session. So
generating N tokens is N calls of one step with no host work in between. A mixed call
(``run_mixed``: the step and prompts prefilled into free rows, one pass over the weights)
feeds the same way, and also puts each prompt's first token and position into its row.

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
1 ms). Mixed calls are recorded per tier and mixed length (their prompts packed into one
stream, padded to that length) with ``MIXED_GRAPH_PROMPTS`` prompt entries, the unused ones
placeholders, on the step's inputs. Longer calls run as ordinary calls, their launches
hidden behind the work. The caches are zeroed after every recording. CPU sessions run the
same calls eagerly.

``generate`` syncs with the host only every ``EOS_CHECK_EVERY`` steps to see whether every
row has stopped, so the host queues replays ahead of the GPU instead of waiting on each
token. Rows keep running after their EOS; their extra tokens are cut off afterwards, so the
result equals stopping at once.

The host mirrors what the device holds for the slot calls (``SessionSlots`` drives them):
the next position of each row in use (``next``, None: free), the position the device holds
for each row (``held``, None: unknown after a whole-batch call) and the rows ``live`` marks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pipeline.runtime.cuda_graphs import Recorder, StaticGraph
from pipeline.runtime.graph_loading import BucketGraphs
from pipeline.runtime.pending import to_device
from pipeline.runtime.runners import until_eos
from pipeline.runtime.sampler_graph import RecordedSampler

EOS_CHECK_EVERY = {"cpu": 1, "cuda": 8}  # steps between host syncs (cpu has nothing to queue)
# Prefill calls recorded as CUDA graphs: up to this many prompts (serve's --max-prefills
# default admits 4 per iteration) and this many positions in all (above it the work hides
# the launches, and each graph would hold more memory for nothing).
PREFILL_GRAPH_PROMPTS = 8
PREFILL_GRAPH_TOKENS = 4096
# Mixed calls recorded with this many prompt entries (placeholders fill those a call does not
# use; the engine folds at most --max-prefills, 4 by default), at every key tier and mixed
# length up to PREFILL_GRAPH_TOKENS. A call of more prompts runs as an ordinary call.
MIXED_GRAPH_PROMPTS = 8

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
        self.inputs: tuple[Tensor, Tensor] = (
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
                    self.inputs,
                    self._fixed(n),
                    recorder=recorder,
                    inputs=inputs,
                )
                self._steps[n], inputs = step, step.inputs
            self.inputs = inputs  # type: ignore[assignment]
        self._prefills: dict[tuple[int, int], StaticGraph] = {}  # (prompts, length) -> graph
        self._mixed: dict[tuple[int, int], StaticGraph] = {}  # (tier, length)
        if self._steps:
            self._record_calls(recorder)
        # The host's mirror of the rows (module docstring; ``SessionSlots`` keeps it).
        self.next: list[int | None] = [None] * b
        self.held: list[int | None] = [0] * b
        self.live_rows: tuple[int, ...] | None = ()
        # Rows that sample draw after the call; graphed, that draw is recorded too
        # (``pipeline.runtime.sampler_graph``).
        self.sampler = None
        if self._steps:
            self.sampler = RecordedSampler(self.inputs[0], recorder)
            argmax, logits = self._steps[self.tiers[-1]].outputs
            self.sampler.prepare(logits, argmax)

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

    @property
    def prefill_graphs(self) -> list[tuple[int, int]]:
        """(prompts, length) of every prefill call recorded as a graph."""
        return sorted(self._prefills)

    @property
    def mixed_graphs(self) -> list[tuple[int, int]]:
        """(tier, length) of every mixed call recorded as a graph."""
        return sorted(self._mixed)

    @property
    def mixed_prompts(self) -> int:
        """The prompt entries a recorded mixed call takes (0: none recorded)."""
        return min(self.spec.mixed_batch, MIXED_GRAPH_PROMPTS) if self._mixed else 0

    @property
    def recorded(self) -> int:
        """CUDA graphs recorded: steps, prefill and mixed calls (0: an eager session)."""
        return len(self._steps) + len(self._prefills) + len(self._mixed)

    # --- the calls slots make (``SessionSlots``): queued, tokens left on the device --------

    def run_prefill(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """A prefill call on device ``inputs`` (tokens, lengths, slots), its recorded graph
        where it has one: (logits [P, V], next tokens [P]), the graph's buffers."""
        graph = self._prefills.get(tuple(inputs[0].shape))
        if graph is not None:
            graph(*inputs)
            return graph.outputs[0], graph.outputs[1]
        return self.graphs.run_prefill(inputs, self.k_cache, self.v_cache)

    def run_step(self, tier: int) -> tuple[Tensor, Tensor]:
        """One greedy step of every row from the step's inputs, fed back into them, attending
        ``tier`` positions: (next tokens [B], logits [B, V])."""
        if self._steps:
            self._steps[tier].replay()
            return self._steps[tier].outputs[0], self._steps[tier].outputs[1]
        return self._greedy_step(*self.inputs, *self._fixed(tier))

    def run_mixed(self, tier: int, prompts: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """``run_step`` and a prefill of device ``prompts`` (the packed stream, lengths, slots:
        rows the step leaves alone; ``BucketGraphs.mixed_inputs``) in one mixed call; each
        prompt's first token and position go into its row's step inputs: (next tokens
        [B + P], logits [B + P, V])."""
        t, p = prompts[0].shape[0], prompts[1].shape[0]
        graph = self._mixed.get((tier, t)) if p == self.mixed_prompts else None
        if graph is not None:
            for dst, src in zip(graph.inputs[2:], prompts, strict=True):
                dst.copy_(src)
            graph.replay()
            return graph.outputs[0], graph.outputs[1]
        return self._mixed_step(*self.inputs, *prompts, *self._fixed(tier))

    def set_live(self, rows: tuple[int, ...]) -> None:
        """The rows the next step advances (the others keep their token and position)."""
        if self.live_rows != rows:
            live = torch.zeros((self.spec.batch,), dtype=torch.int64)
            live[list(rows)] = 1
            self.live.copy_(to_device(live, self.device))
            self.live_rows = rows

    def park(self, rows: Sequence[int]) -> None:
        """Put ``rows`` (not stepped, their held position past the cache or unknown) at
        position 0, inside their own row, so that a step's write for them stays in bounds."""
        where = to_device(torch.tensor(list(rows)), self.device)
        self.inputs[1].index_fill_(0, where, 0)
        self.inputs[0].index_fill_(0, where, 0)
        for r in rows:
            self.held[r] = 0

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
        check_every = EOS_CHECK_EVERY.get(self.device.type, 8)
        done = 1  # tokens generated so far, per row
        stop = on_tokens is not None and bool(on_tokens(first.tolist()))
        while done < max_new_tokens and not stop:
            check = eos_token_id is not None and done % check_every == 0
            if check and self._all_stopped(lengths, done, n, eos_token_id):
                break
            self.run_step(self.tier(longest + done))  # up to the last row's newest position
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
        self._feed(tokens, positions, generated, live, nxt)
        return nxt, logits

    def _mixed_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        prompt_tokens: Tensor,
        prompt_lengths: Tensor,
        prompt_slots: Tensor,
        k: Tensor,
        v: Tensor,
        generated: Tensor,
        live: Tensor,
        keys: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """``_greedy_step`` with prompts prefilled in the same call (the mixed graph); each
        prompt's first token and position then go into its row's inputs: (next tokens
        [B + P], logits [B + P, V])."""
        logits, nxt = self.graphs.mixed(
            tokens, positions, *(prompt_tokens, prompt_lengths, prompt_slots), k, v, keys
        )
        b = tokens.shape[0]
        self._feed(tokens, positions, generated, live, nxt[:b])
        # a placeholder (length 0) feeds what the prompt before it feeds, into the same row:
        # a row written twice gets the same values twice
        entry = torch.arange(prompt_lengths.shape[0], device=prompt_lengths.device)
        real = torch.where(prompt_lengths > 0, entry, 0).cummax(0).values
        rows = prompt_slots[real]
        tokens.index_copy_(0, rows, nxt[b:][real, None])
        positions.index_copy_(0, rows, prompt_lengths[real])
        return nxt, logits

    def _feed(
        self, tokens: Tensor, positions: Tensor, generated: Tensor, live: Tensor, nxt: Tensor
    ) -> None:
        # The token is for the next position; clamped so a step past the end (which
        # callers never take) cannot index out of bounds inside a CUDA graph.
        where = (positions + 1).clamp(max=self.spec.seq)
        generated.scatter_(1, where[:, None], nxt[:, None])
        # rows not stepped (live 0) keep their token and position: a row held for a step
        # is fed the same token at the same place when it steps again
        tokens.copy_(torch.where(live[:, None] > 0, nxt[:, None], tokens))
        positions.add_(live)

    def _prefill_rows(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Whole-batch prefill, row r into slot r; each row's first token goes into
        ``generated``. (logits [B', V], next tokens [B'])."""
        self._mark_batch()
        tokens, lengths = _on(self.device, tokens, lengths)
        logits, nxt = self.graphs.prefill_rows(tokens, lengths, self.k_cache, self.v_cache)
        self.generated[torch.arange(len(lengths), device=self.device), lengths] = nxt
        return logits, nxt

    def _record_calls(self, recorder: Recorder | None) -> None:
        """One prefill graph per (prompt count, prefill length) and one mixed graph per
        (tier, mixed length), within the limits above, in one memory pool. Their warmup
        calls write the caches and the step's inputs, zeroed after."""
        spec, dev = self.spec, self.device
        pool = torch.cuda.graph_pool_handle() if recorder is None else None
        for t in spec.prefill_lengths:
            for p in range(1, min(spec.prefill_batch, PREFILL_GRAPH_PROMPTS) + 1):
                if p * t > PREFILL_GRAPH_TOKENS:
                    break
                prompts = (
                    torch.zeros((p, t), dtype=torch.int64, device=dev),
                    torch.full((p,), t, dtype=torch.int64, device=dev),
                    torch.arange(p, dtype=torch.int64, device=dev),  # distinct rows
                )
                self._prefills[p, t] = StaticGraph(
                    self.graphs.prefills[t],
                    prompts,
                    (self.k_cache, self.v_cache),
                    recorder=recorder,
                    inputs=prompts,
                    pool=pool,
                )
        p = min(spec.mixed_batch, MIXED_GRAPH_PROMPTS)
        for t in spec.mixed_lengths if p else ():
            if t > PREFILL_GRAPH_TOKENS:
                break
            # one-token prompts in distinct rows: each warmup feeds 1 on as their rows'
            # positions, where the next warmup's step writes (inside the cache)
            prompts = (
                torch.zeros((t,), dtype=torch.int64, device=dev),
                torch.ones((p,), dtype=torch.int64, device=dev),
                torch.arange(p, dtype=torch.int64, device=dev),
            )
            for n in self.tiers:  # on the step's inputs
                self._mixed[n, t] = StaticGraph(
                    self._mixed_step,
                    (*self.inputs, *prompts),
                    self._fixed(n),
                    recorder=recorder,
                    inputs=(*self.inputs, *prompts),
                    pool=pool,
                )
        for t in (self.k_cache, self.v_cache, *self.inputs):
            t.zero_()

    def _fixed(self, n: int) -> tuple[Tensor, ...]:
        return (self.k_cache, self.v_cache, self.generated, self.live, self._keys[n])

    def _load(self, tokens: Tensor, positions: Tensor, rows: int) -> None:
        """The step's inputs for a batch in rows 0..rows-1 (the rest not in use)."""
        b = self.spec.batch
        self.live.copy_((torch.arange(b) < rows).to(torch.int64))
        self.inputs[0].zero_()
        self.inputs[1].zero_()
        self.inputs[0][:rows].copy_(tokens)
        self.inputs[1][:rows].copy_(positions)

    def _mark_batch(self) -> None:
        """Whole-batch calls take every row: no slot survives them, and they leave the step's
        inputs as they please."""
        if any(pos is not None for pos in self.next):
            raise RuntimeError("this bucket's slots are in use: free them before a batch call")
        self.held = [None] * self.spec.batch
        self.live_rows = None

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


def _on(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    # The packages assume dense row-major inputs: a column slice is not.
    return tuple(t.to(device).contiguous() for t in tensors)
