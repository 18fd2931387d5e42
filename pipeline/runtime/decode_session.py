"""One compiled bucket ready to serve: its graphs, its own KV caches, and greedy decoding.

    session = DecodeSession(BucketGraphs(bucket_dir))
    session.generate([[1, 2, 3]], max_new_tokens=16)

A greedy step is the decode graph (which also returns the argmax) plus three small updates
that feed it its own output: the next token becomes the input, positions advance by one, and
the token is written at its position into ``generated``, a [B, S+1] buffer of the session. So
generating N tokens is N calls of one step with no host work in between.

A step attends only the first S' cache positions, S' the shortest of ``spec.key_tiers`` that
holds every position so far (the host knows it: the longest prompt plus the steps taken), so
decode in a long bucket costs what the filled length costs.

On cuda that step is recorded as a CUDA graph (``pipeline.runtime.cuda_graphs``), one per
tier, all on the same input tensors, when the session is made: the caches are allocated here
and captured by address before any prefill has filled them, so the capture's warmup calls can
only overwrite zeros. Each token is then one replay, with no copy in or out; crossing a tier
switches graphs, also with no copy. Prefill stays an ordinary call (compute-bound, once per
request). CPU sessions run the same step eagerly.

The loop syncs with the host only every ``EOS_CHECK_EVERY`` steps to see whether every row
has stopped, so the host queues replays ahead of the GPU instead of waiting on each token.
Rows keep running after their EOS; their extra tokens are cut off afterwards, so the result
equals stopping at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from pipeline.runtime.cuda_graphs import Recorder, StaticGraph
from pipeline.runtime.graph_abi import BucketGraphs

EOS_CHECK_EVERY = {"cpu": 1, "cuda": 8}  # steps between host syncs (cpu has nothing to queue)

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
        self.tiers = tiers or self.spec.key_tiers
        if self.tiers[-1] != s or list(self.tiers) != sorted(set(self.tiers)):
            raise ValueError(f"tiers {self.tiers} must rise to the bucket length {s}")
        self._keys = {n: torch.arange(n, device=dev) for n in self.tiers}
        self._steps: dict[int, StaticGraph] = {}
        if recorder is not None or (cuda_graphs and self.device.type == "cuda"):
            if recorder is None and not graphs.single_threaded:
                raise ValueError(
                    "CUDA graphs need packages loaded with BucketGraphs(..., single_threaded=True)"
                )
            like = (
                torch.zeros((b, 1), dtype=torch.int64, device=dev),
                torch.zeros((b,), dtype=torch.int64, device=dev),
            )
            inputs = None
            for n in self.tiers:
                fixed = (self.k_cache, self.v_cache, self.generated, self._keys[n])
                step = StaticGraph(self._greedy_step, like, fixed, recorder=recorder, inputs=inputs)
                self._steps[n], inputs = step, step.inputs

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

    def prefill(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, S], lengths [B] → fp32 logits [B, V] of each row's last real token."""
        return self._prefill(tokens, lengths)[0]

    def decode(self, tokens: Tensor, positions: Tensor, attended: int | None = None) -> Tensor:
        """tokens [B, 1] at positions [B] → fp32 logits [B, V].

        ``attended``: a bound on max(positions) + 1 when the caller knows one (else it is
        read from ``positions``, a host sync on cuda). With CUDA graphs the result is the
        graph's output buffer, overwritten by the next decode: clone it to keep it."""
        n = self.tier(attended if attended is not None else int(positions.max()) + 1)
        tokens, positions = _on(self.device, tokens, positions)
        if self._steps:
            return self._steps[n](tokens, positions)
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
        n, b, s = len(prompts), self.spec.batch, self.spec.seq
        longest = max(len(p) for p in prompts)
        tokens = torch.zeros((b, s), dtype=torch.int64)
        lengths = torch.ones(b, dtype=torch.int64)  # unused rows: one pad token
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
            lengths[row] = len(p)
        _, first = self._prefill(tokens, lengths)
        lengths = lengths.to(self.device)
        self.generated.scatter_(1, lengths[:, None], first[:, None])
        step = self._advance(first[:, None], lengths)
        check_every = EOS_CHECK_EVERY.get(self.device.type, 8)
        done = 1  # tokens generated so far, per row
        stop = on_tokens is not None and bool(on_tokens(first[:n].tolist()))
        while done < max_new_tokens and not stop:
            check = eos_token_id is not None and done % check_every == 0
            if check and self._all_stopped(lengths, done, n, eos_token_id):
                break
            step(longest + done)  # attends up to the last row's newest position
            done += 1
            if on_tokens is not None:
                stop = bool(on_tokens(self._column(lengths, done, n)))
        rows = self.generated[:n].tolist()
        starts = lengths[:n].tolist()
        return [_until(r[p : p + done], eos_token_id) for r, p in zip(rows, starts, strict=True)]

    def _prefill(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        tokens, lengths = _on(self.device, tokens, lengths)
        logits, nxt = self.graphs.prefill(tokens, lengths, self.k_cache, self.v_cache)
        return logits, nxt  # (fp32 [B, V], int64 [B])

    def _greedy_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        k: Tensor,
        v: Tensor,
        generated: Tensor,
        keys: Tensor,
    ) -> Tensor:
        """Decode ``tokens`` at ``positions``, then feed the result back in, in place."""
        logits, nxt = self.graphs.decode(tokens, positions, k, v, keys)
        # The token is for the next position; clamped so a step past the end (which
        # generate never takes) cannot index out of bounds inside a CUDA graph.
        where = (positions + 1).clamp(max=self.spec.seq)
        generated.scatter_(1, where[:, None], nxt[:, None])
        tokens.copy_(nxt[:, None])
        positions.add_(1)
        return logits

    def _advance(self, tokens: Tensor, positions: Tensor) -> Callable[[int], Any]:
        """A call that runs one greedy step from ``tokens`` at ``positions`` onward, given
        how many cache positions it attends."""
        if self._steps:
            self._steps[self.tiers[0]].load(tokens, positions)  # every tier's inputs
            return lambda attended: self._steps[self.tier(attended)].replay()
        state = (tokens.clone(), positions.clone(), self.k_cache, self.v_cache, self.generated)
        return lambda attended: self._greedy_step(*state, self._keys[self.tier(attended)])

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


def _until(row: list[int], eos: int | None) -> list[int]:
    return row[: row.index(eos) + 1] if eos is not None and eos in row else row


def _on(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    # The packages assume dense row-major inputs: a column slice is not.
    return tuple(t.to(device).contiguous() for t in tensors)
