"""Record a fixed-shape call once as a CUDA graph and replay it, gpt-fast style.

    step = StaticGraph(decode, (tokens, positions), fixed=(k_cache, v_cache))
    logits = step(tokens, positions)   # copy in, replay, read the captured output

A CUDA graph replays the recorded kernels on the recorded addresses. So the graph owns its
input tensors (``StaticGraph`` allocates them; nobody else can hold them), every call copies
the new values into them, and the result is always the tensor the capture produced: a view
that the next call overwrites. ``fixed`` tensors (KV caches, which the graphs update in
place) are captured by address and must outlive the graph; the weights bound to an
AOTInductor package are fixed the same way.

Capture happens in the constructor, after ``warmup`` eager calls (they load kernels and
allocate workspaces, which capture forbids). Those calls run ``fn`` on zeroed inputs, so they
write into ``fixed``: build the graph before the caches hold anything worth keeping.

The recorder is injectable so the copy-in/read-out logic is tested on CPU (tests record with
a stand-in that re-runs ``fn`` into the same output tensor, which is what a replay does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

WARMUP_CALLS = 2


class Recorder(Protocol):
    def __call__(self, fn: Callable[[], Any], warmup: int) -> tuple[Callable[[], Any], Any]:
        """Run ``fn`` ``warmup`` times, record it once; return (replay, recorded output)."""
        ...


def cuda_recorder(
    fn: Callable[[], Any], warmup: int, pool: Any = None
) -> tuple[Callable[[], Any], Any]:
    """torch.cuda.CUDAGraph capture, with warmup on a side stream as PyTorch requires.
    ``pool`` (``torch.cuda.graph_pool_handle()``): a memory pool shared with other graphs
    that never replay at the same time, so their intermediates take one allocation."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out  # the bound method keeps the graph (and its memory pool) alive


class StaticGraph:
    """``fn(*inputs, *fixed) -> Tensor`` recorded once on graph-owned input tensors."""

    def __init__(
        self,
        fn: Callable[..., Any],
        like: Sequence[Tensor],
        fixed: Sequence[Tensor] = (),
        *,
        recorder: Recorder | None = None,
        warmup: int = WARMUP_CALLS,
        inputs: Sequence[Tensor] | None = None,
        pool: Any = None,
    ) -> None:
        """``inputs``: the input tensors to record on (another ``StaticGraph``'s, so graphs of
        one step at several sizes share their state with no copies to switch; or tensors
        holding the values the warmup calls should see). ``pool``: see ``cuda_recorder``
        (ignored by an injected recorder)."""
        # Zeroed copies of ``like``'s shapes: the only tensors the graph reads its inputs from.
        self.inputs = (
            tuple(inputs)
            if inputs is not None
            else tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in like)
        )
        self.fixed = tuple(fixed)  # referenced, so the captured addresses stay valid
        record = recorder or functools.partial(cuda_recorder, pool=pool)
        self._replay, out = record(lambda: _as_tuple(fn(*self.inputs, *self.fixed)), warmup)
        self.outputs: tuple[Tensor, ...] = out  # every output fn returned, as captured
        self.output = out[0]

    def __call__(self, *values: Tensor) -> Tensor:
        """Copy ``values`` into the static inputs, replay, return the static output.

        The returned tensor is overwritten by the next call: clone it to keep it."""
        self.load(*values)
        self.replay()
        return self.output

    def load(self, *values: Tensor) -> None:
        """Copy ``values`` into the static inputs (shapes and dtypes must match the capture)."""
        if len(values) != len(self.inputs):
            raise ValueError(f"expected {len(self.inputs)} inputs, got {len(values)}")
        for i, (dst, src) in enumerate(zip(self.inputs, values, strict=True)):
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(
                    f"input {i}: {src.dtype} {list(src.shape)} does not match the recorded "
                    f"{dst.dtype} {list(dst.shape)}"
                )
            dst.copy_(src)

    def replay(self) -> None:
        """Run the recorded kernels on whatever the static inputs hold now (a step that
        updates its own inputs, as a greedy decode step does, is replayed with no copies)."""
        self._replay()


def _as_tuple(out: Any) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)
