"""One compiled bucket ready to serve: its graphs, its own KV caches, and greedy decoding.

    session = DecodeSession(BucketGraphs(bucket_dir))
    session.generate([[1, 2, 3]], max_new_tokens=16)

On cuda the decode graph is recorded as a CUDA graph (``pipeline.cuda_graphs``) when the
session is made: the caches are allocated here and captured by address before any prefill has
filled them, so the capture's warmup calls can only overwrite zeros. Each decode step is then
one replay. Prefill stays an ordinary call (compute-bound, launched once per request). CPU
sessions call the graphs directly.

The greedy loop keeps tokens on the device and syncs with the host only every
``EOS_CHECK_EVERY`` steps to see whether every row has stopped, so the host queues replays
ahead of the GPU instead of waiting on each token. Rows keep running after their EOS; their
extra tokens are cut off afterwards, so the result equals stopping at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pipeline.cuda_graphs import Recorder, StaticGraph
from pipeline.graph_abi import BucketGraphs

EOS_CHECK_EVERY = {"cpu": 1, "cuda": 8}  # steps between host syncs (cpu has nothing to queue)


class DecodeSession:
    def __init__(
        self,
        graphs: BucketGraphs,
        *,
        cuda_graphs: bool = True,
        recorder: Recorder | None = None,
    ) -> None:
        """``recorder`` overrides how the decode step is recorded (tests record on CPU)."""
        self.graphs = graphs
        self.spec = graphs.spec
        self.device = torch.device(graphs.device)
        self.k_cache, self.v_cache = graphs.new_cache()
        self._step: StaticGraph | None = None
        if recorder is not None or (cuda_graphs and self.device.type == "cuda"):
            if recorder is None and not graphs.single_threaded:
                raise ValueError(
                    "CUDA graphs need packages loaded with BucketGraphs(..., single_threaded=True)"
                )
            b, dev = self.spec.batch, self.device
            like = (
                torch.zeros((b, 1), dtype=torch.int64, device=dev),
                torch.zeros((b,), dtype=torch.int64, device=dev),
            )
            caches = (self.k_cache, self.v_cache)
            self._step = StaticGraph(graphs.decode, like, caches, recorder=recorder)

    @property
    def batch(self) -> int:
        return self.spec.batch

    @property
    def seq(self) -> int:
        return self.spec.seq

    @property
    def graphed(self) -> bool:
        return self._step is not None

    def prefill(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, S], lengths [B] → fp32 logits [B, V] of each row's last real token."""
        tokens, lengths = _on(self.device, tokens, lengths)
        return _first(self.graphs.prefill(tokens, lengths, self.k_cache, self.v_cache))

    def decode(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens [B, 1] at positions [B] → fp32 logits [B, V].

        With CUDA graphs the result is the graph's output buffer, overwritten by the next
        decode: clone it to keep it."""
        tokens, positions = _on(self.device, tokens, positions)
        if self._step is not None:
            return self._step(tokens, positions)
        return _first(self.graphs.decode(tokens, positions, self.k_cache, self.v_cache))

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None
    ) -> list[list[int]]:
        """Greedy: the new tokens of each prompt, each ending at its first EOS (if any)."""
        self._check(prompts, max_new_tokens)
        n, b, dev = len(prompts), self.spec.batch, self.device
        tokens = torch.zeros((b, self.spec.seq), dtype=torch.int64)
        lengths = torch.ones(b, dtype=torch.int64)  # unused rows: one pad token
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
            lengths[row] = len(p)
        logits = self.prefill(tokens, lengths)
        positions = lengths.to(dev)  # where each row's next token goes
        out = torch.empty((b, max_new_tokens), dtype=torch.int64, device=dev)
        check_every = EOS_CHECK_EVERY.get(dev.type, 8)
        step = 0
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)
            out[:, step] = nxt
            if step == max_new_tokens - 1:
                break
            check = eos_token_id is not None and (step + 1) % check_every == 0
            if check and bool((out[:n, : step + 1] == eos_token_id).any(1).all()):
                break
            logits = self.decode(nxt[:, None], positions)
            positions = positions + 1
        rows = out[:n, : step + 1].tolist()
        return [_until(row, eos_token_id) for row in rows]

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


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (list, tuple)) else out
