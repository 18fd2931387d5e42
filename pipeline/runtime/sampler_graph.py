"""The sampler over every row of a bucket's step, recorded as a CUDA graph.

Eager, a draw is some 30 small kernels launched one by one after the step's graph (the
hash, the Gumbel noise, for top-p/top-k a sort of the vocabulary): on an H200 it doubled a
batch-32 step, 1.22 → 2.48 ms (bench/RESULTS.md, thirteenth round), launches rather than
work. Recorded, it is one replay: the rows' parameters go into the graph's own input
buffers (every row of the bucket; the rows that do not sample are masked out and keep
their argmax), the step's logits and argmax are copied in, and the drawn tokens replace the
argmax in the step's fed input, so the next step draws on from them with no host work.

The math is ``sampling.draw``'s, so the tokens are the eager sampler's (the tests compare
them). One graph per kind: with a top-k/top-p filter (the sort) or without, both recorded
when the session is made (after the steps, before any prefill); should recording fail, the
session draws eagerly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pipeline.runtime.cuda_graphs import Recorder, StaticGraph
from pipeline.runtime.pending import to_device
from pipeline.runtime.sampling import Draws, SamplingParams, draw, row_key

log = logging.getLogger("inf2_pipeline.runtime")


class RecordedSampler:
    def __init__(self, tokens: Tensor, recorder: Recorder | None = None) -> None:
        """``tokens``: the step's fed input [B, 1], which the drawn tokens go into."""
        self.tokens = tokens
        self.recorder = recorder
        self._graphs: dict[bool, StaticGraph | None] = {}
        self._buffers: tuple[Tensor, ...] | None = None

    def prepare(self, logits: Tensor, argmax: Tensor) -> None:
        """Record both kinds now (a session does it when it is made), so the first sampled
        request pays for no recording; ``logits``/``argmax``: any step's outputs."""
        for filtered in (False, True):
            self._graph(filtered, logits, argmax)

    def __call__(
        self, logits: Tensor, argmax: Tensor, rows: Sequence[tuple[int, SamplingParams, int]]
    ) -> Tensor | None:
        """``rows``: (row, params, index of the token drawn) of each row that samples. The
        next token of every row [B] (the graph's output buffer, overwritten by the next
        call), or None where no graph could be recorded (the caller draws eagerly)."""
        filtered = any(p.top_k or p.top_p < 1 for _, p, _ in rows)
        graph = self._graph(filtered, logits, argmax)
        if graph is None:
            return None
        b = self.tokens.shape[0]
        floats = torch.ones((b, 2), dtype=torch.float32)  # temperature, top_p
        ints = torch.zeros((b, 2), dtype=torch.int64)  # top_k, the row's key
        mask = torch.zeros((b,), dtype=torch.int64)
        for r, p, n in rows:
            floats[r, 0], floats[r, 1] = p.temperature, p.top_p
            ints[r, 0], ints[r, 1] = p.top_k, row_key(p.seed, n)
            mask[r] = 1
        dev = self.tokens.device
        graph.load(logits, argmax, *(to_device(t, dev) for t in (floats, ints, mask)))
        graph.replay()
        return graph.output

    def _graph(self, filtered: bool, logits: Tensor, argmax: Tensor) -> StaticGraph | None:
        if filtered not in self._graphs:
            try:
                self._graphs[filtered] = self._record(filtered, logits, argmax)
            except Exception as e:  # the eager sampler still draws the same tokens
                why = f"{type(e).__name__}: {e}"
                log.warning("the sampler could not be recorded (%s): drawing eagerly", why)
                self._graphs[filtered] = None
        return self._graphs[filtered]

    def _record(self, filtered: bool, logits: Tensor, argmax: Tensor) -> StaticGraph:
        if self._buffers is None:  # shared by both kinds: they never replay at once
            b = self.tokens.shape[0]
            self._buffers = (
                torch.zeros_like(logits),
                torch.zeros_like(argmax),
                to_device(torch.ones((b, 2), dtype=torch.float32), self.tokens.device),
                torch.zeros((b, 2), dtype=torch.int64, device=self.tokens.device),
                torch.zeros((b,), dtype=torch.int64, device=self.tokens.device),
            )
        # the warm-up and capture calls run with every row masked: the fed tokens stay
        return StaticGraph(
            functools.partial(_draw_rows, filtered=filtered),
            self._buffers,
            (self.tokens,),
            recorder=self.recorder,
            inputs=self._buffers,
        )


def _draw_rows(
    logits: Tensor,
    argmax: Tensor,
    floats: Tensor,
    ints: Tensor,
    mask: Tensor,
    tokens: Tensor,
    *,
    filtered: bool,
) -> Any:
    """Every row drawn; the masked-in rows' tokens replace their argmax, in the output and
    in the step's fed input."""
    drawn = draw(logits, Draws(floats, ints, filtered))
    keep = mask > 0
    tokens[:, 0].copy_(torch.where(keep, drawn, tokens[:, 0]))
    return torch.where(keep, drawn, argmax)
