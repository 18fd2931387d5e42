"""A ``DecodeSession``'s rows as slots: the ``Slots`` interface (``pipeline.runtime.runners``)
that the serving engine drives on cpu and cuda.

    slots = SessionSlots(DecodeSession(BucketGraphs(bucket_dir)))
    first = slots.prefill(0, [1, 2, 3])                   # one request per slot
    slots.step([0])                                        # one token for each given slot
    slots.launch_mixed([0], [1], [[4, 5]])                 # a step and a prompt in one call

The step's inputs live on the device: a prefill writes its rows' first tokens and positions
there, each step feeds its own output on, and the host sends only the live mask when the
rows stepped change. So ``launch``, ``launch_prefill`` and ``launch_mixed`` queue their work
and return the tokens as ``Pending`` (read when the server asks, ``pipeline.runtime.pending``):
the server launches a step before it reads the last one's tokens, and the device does not
wait for the host in between.

A mixed call (``launch_mixed``) is a step of the given rows and prompts prefilled into free
rows, in one pass over the weights (graph ABI 6, ``mixed.pt2``: the prompts packed end to
end into one stream): on a GPU a short prompt's own prefill call costs about a step, so a
prompt admitted into a running bucket rides in that bucket's step instead (``serve
--fold-prompts``).

Rows that sample draw from the call's logits after it (``pipeline.runtime.sampling``): a
step's rows by the session's recorded sampler where it has one, a prompt's first token
eagerly (once per request).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pipeline.runtime.decode_session import DecodeSession
from pipeline.runtime.pending import DeviceTokens, Pending, RanThenFailed, to_device
from pipeline.runtime.sampling import Draws, SamplingParams, SlotSampling, draw


class SessionSlots:
    def __init__(self, session: DecodeSession) -> None:
        self.session = session
        self.batch = session.batch
        self.seq = session.seq
        # Rows that sample (the others take the graph's argmax).
        self._sampling = SlotSampling()

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        """The prompt lengths this bucket has prefill graphs for."""
        return self.session.spec.prefill_lengths

    @property
    def prefill_batch(self) -> int:
        """Prompts one ``prefill_many`` call takes."""
        return self.session.spec.prefill_batch

    @property
    def mixed_lengths(self) -> tuple[int, ...]:
        """The stream lengths ``launch_mixed`` takes: its prompts, end to end, are padded to
        the shortest that holds them."""
        return self.session.spec.mixed_lengths

    @property
    def mixed_batch(self) -> int:
        """Prompts one ``launch_mixed`` call takes (0: none); where mixed calls are recorded
        as CUDA graphs, as many as those take (a call of more would launch every kernel)."""
        return self.session.mixed_prompts or self.session.spec.mixed_batch

    def prefill_positions(self, prompt: int) -> int:
        """Positions a prefill of ``prompt`` tokens computes: its prefill graph's length."""
        return self.session.spec.prefill_length(prompt)

    @property
    def slots_in_use(self) -> list[int]:
        return [r for r, pos in enumerate(self.session.next) if pos is not None]

    # --- prefills ----------------------------------------------------------------------------

    def prefill(
        self, slot: int, prompt: Sequence[int], sampling: SamplingParams | None = None
    ) -> int:
        """Fill row ``slot`` with ``prompt`` (its other rows untouched); the first new token."""
        params = None if sampling is None else [sampling]
        return self.prefill_many([slot], [prompt], params)[0]

    def prefill_many(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> list[int]:
        """Fill each of ``slots`` with its prompt, in one prefill call (at most
        ``prefill_batch`` prompts): the first new token of each, greedy or drawn under its
        ``sampling`` params (which the slot keeps until it is freed)."""
        return self.launch_prefill(slots, prompts, sampling).tokens()

    def launch_prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> Pending:
        """``prefill_many`` queued: the first tokens are written into the step's inputs on
        the device (a ``launch`` right after steps from them) and read when asked."""
        s = self.session
        inputs = self._prompt_inputs(slots, prompts)
        drawn, rows = self._assign(slots, sampling)
        logits, nxt = s.run_prefill(inputs)
        if rows is not None:
            nxt = _with_drawn(nxt, logits, to_device(torch.tensor(drawn), s.device), rows)
        where = inputs[2]
        s.inputs[0][:, 0].index_copy_(0, where, nxt)
        s.inputs[1].index_copy_(0, where, inputs[1])
        self._started(slots, prompts)
        return DeviceTokens(nxt)

    # --- steps -------------------------------------------------------------------------------

    def step(self, slots: Sequence[int]) -> list[int]:
        """One step for each of ``slots``: the next token of each, in order."""
        return self.launch(slots).tokens()

    def launch(self, slots: Sequence[int]) -> Pending:
        """``step`` queued: the step's work goes to the device at once; its tokens are read
        when asked, so the host may launch the next step first (each feeds its own output
        to the next on the device)."""
        order, tier = self._stage(slots)
        drawn = self._sampling.sampled(sorted(order))
        taken = self._sampling.take(drawn)
        nxt, logits = self.session.run_step(tier)
        if drawn:  # the step fed its argmax back in: those rows get their drawn token instead
            nxt = self._draw(logits, nxt, drawn, taken)
        self._advanced(order)
        return DeviceTokens(nxt, order)  # copied before the next step overwrites it

    def launch_mixed(
        self,
        slots: Sequence[int],
        prompt_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> Pending:
        """``launch`` of ``slots`` and ``launch_prefill`` of ``prompts`` into ``prompt_slots``
        (free rows) in one mixed call (at most ``mixed_batch`` prompts, whose tokens in all
        fit one of ``mixed_lengths``): the step's tokens in the order of ``slots``, then
        each prompt's first token. Raises before anything runs on a call it cannot take (the
        caller may run them apart), and ``RanThenFailed`` when the device ran it and what
        followed failed (the rows moved on: the caller fails them)."""
        nxt, _, rows = self._mixed(slots, prompt_slots, prompts, sampling)
        return DeviceTokens(nxt, rows)

    def mixed_logits(
        self, slots: Sequence[int], prompt_slots: Sequence[int], prompts: Sequence[Sequence[int]]
    ) -> Tensor:
        """The fp32 logits of a greedy ``launch_mixed`` on the host, [len(slots) + P, V]: each
        step row's, then each prompt's last token's (parity's view of the server's call)."""
        _, logits, rows = self._mixed(slots, prompt_slots, prompts, None)
        return logits[torch.tensor(rows, device=logits.device)].float().cpu()

    def _mixed(
        self,
        slots: Sequence[int],
        prompt_slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None,
    ) -> tuple[Tensor, Tensor, list[int]]:
        """The mixed call: (tokens, logits, the rows of both that answer ``slots`` then the
        prompts)."""
        s = self.session
        entries = s.mixed_prompts if len(prompts) <= s.mixed_prompts else 0
        host = s.graphs.mixed_inputs(prompt_slots, [list(p) for p in prompts], entries)
        inputs = tuple(to_device(t, s.device) for t in host)
        busy = set(prompt_slots) & set(self.slots_in_use)
        if busy:
            raise ValueError(f"slots {sorted(busy)} are in use: a prompt needs a free slot")
        order, tier = self._stage(slots)
        before = self._sampling.state()
        try:
            drawn = self._sampling.sampled(sorted(order))
            taken = self._sampling.take(drawn)
            first_drawn, first_rows = self._assign(prompt_slots, sampling)
            nxt, logits = s.run_mixed(tier, inputs)
        except Exception:  # nothing ran: the draws were not taken
            self._sampling.restore(before)
            raise
        # the device has run the call: the host follows it, whatever fails after
        self._advanced(order)
        self._started(prompt_slots, prompts)
        b, p = self.batch, len(prompts)
        step, first = nxt[:b], nxt[b : b + p]  # placeholders after: not theirs
        try:
            if first_rows is not None:  # the graph fed each prompt its argmax: drawn instead
                at = to_device(torch.tensor(first_drawn), s.device)
                first = _with_drawn(first, logits[b : b + p], at, first_rows)
                s.inputs[0][:, 0].index_copy_(0, inputs[2][:p], first)
            if drawn:
                step = self._draw(logits[:b], step, drawn, taken)
            if first_rows is not None or drawn:
                nxt = torch.cat((step, first))
        except Exception as e:
            raise RanThenFailed(f"{type(e).__name__}: {e}") from e
        return nxt, logits, [*order, *range(b, b + len(prompts))]

    def free(self, slot: int) -> None:
        """Row ``slot`` is no longer in use: its cache may be refilled by any prefill."""
        self.session.next[slot] = None
        self._sampling.free(slot)

    # --- the host's side of the rows -----------------------------------------------------------

    def _prompt_inputs(
        self, slots: Sequence[int], prompts: Sequence[Sequence[int]]
    ) -> tuple[Tensor, ...]:
        """A prefill's inputs (tokens, lengths, slots), checked, on the device."""
        s = self.session
        host = s.graphs.prefill_inputs(slots, [list(p) for p in prompts])
        return tuple(to_device(t, s.device) for t in host)

    def _assign(
        self, slots: Sequence[int], sampling: Sequence[SamplingParams] | None
    ) -> tuple[list[int], Draws | None]:
        """Each new request's sampling params to its slot; which of them draw their first
        token (their index among ``slots``) and the sampler's rows for it."""
        params = list(sampling) if sampling is not None else [None] * len(slots)
        for slot, p in zip(slots, params, strict=True):
            self._sampling.assign(slot, p)
        sampled = set(self._sampling.sampled(slots))
        drawn = [i for i, s in enumerate(slots) if s in sampled]
        if not drawn:
            return [], None
        return drawn, self._sampling.draws([slots[i] for i in drawn], self.session.device)

    def _stage(self, slots: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """Check that ``slots`` may step, put the device's rows in order for it (rows not
        stepped keep their token and position: a row in use rewrites the cache entry its
        next step would write, with the same values; a free row writes inside its own row;
        one whose position is past the cache, or unknown after a whole-batch call, is parked
        at 0 first); the rows in the call's order and the tier it attends. (The rows a
        mixed call prefills are free: their step part reads below their held position, and
        its output is ignored.)"""
        s = self.session
        b, seq = self.batch, self.seq
        order = tuple(slots)
        if not order or len(set(order)) != len(order):
            raise ValueError(f"step needs distinct slots in use, got {list(order)}")
        for r in order:
            pos = s.next[r] if 0 <= r < b else None
            if pos is None or pos >= seq:
                raise ValueError(
                    f"slot {r} cannot step: "
                    + ("it is not in use" if pos is None else f"its {seq} positions are full")
                )
        rows = tuple(sorted(order))
        parked = [r for r in range(b) if r not in rows and _past(s.held[r], seq)]
        if parked:
            s.park(parked)
        s.set_live(rows)
        held = [r for r in self.slots_in_use if r not in rows and s.next[r] < seq]  # type: ignore[operator]
        attended = max(s.next[r] for r in (*order, *held)) + 1  # type: ignore[type-var]
        return order, s.tier(attended)

    def _advanced(self, rows: Sequence[int]) -> None:
        s = self.session
        for r in rows:
            s.next[r] += 1  # type: ignore[operator]
            s.held[r] += 1  # type: ignore[operator]

    def _started(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        s = self.session
        for slot, p in zip(slots, prompts, strict=True):
            s.next[slot] = s.held[slot] = len(p)

    def _draw(
        self,
        logits: Tensor,
        nxt: Tensor,
        drawn: list[int],
        taken: list[tuple[SamplingParams, int]],
    ) -> Tensor:
        """The step's tokens with ``drawn``'s rows sampled, also fed to the next step: one
        recorded replay where the step is graphed, else the eager draw of those rows."""
        s = self.session
        if s.sampler is not None:
            rows = [(r, p, i) for r, (p, i) in zip(drawn, taken, strict=True)]
            out = s.sampler(logits, nxt, rows)
            if out is not None:
                return out
        where = to_device(torch.tensor(drawn), s.device)
        params = Draws.of([p for p, _ in taken], [i for _, i in taken], s.device)
        nxt = _with_drawn(nxt, logits, where, params)
        s.inputs[0][where, 0] = nxt[where]
        return nxt


def _with_drawn(nxt: Tensor, logits: Tensor, rows: Tensor, draws: Draws) -> Tensor:
    """``nxt`` (a call's argmax tokens) with ``rows`` drawn from their logits instead."""
    out = nxt.clone()
    out[rows] = draw(logits[rows], draws)
    return out


def _past(position: int | None, seq: int) -> bool:
    """A device position that a step would write outside the cache at (None: unknown)."""
    return position is None or position >= seq
