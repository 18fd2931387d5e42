"""How the cuda backend times Triton kernels while inductor tunes them.

Coordinate-descent tuning times each candidate launch between two CUDA events, each time
after zeroing an L2-sized buffer (torch/_inductor/runtime/benchmarking.py,
``InductorBenchmarker.benchmark_gpu``). For the 2–15 µs kernels of a batch-1 decode step
that figure holds two things a decode step does not have: on an H200 the zeroing ends
(~12 µs) before Python has queued the launch, so the GPU idles inside the timed span, and it
leaves the L2 full of dirty lines that the kernel's reads must first write back. Inside a
step (one replayed CUDA graph) kernels follow each other at once, over an L2 of clean
weights. Tuning chose launch parameters by that noise: the same step compiled twice took
0.988 and 1.095 ms, its down projection 0.17 and 0.24 ms (bench/RESULTS.md).

``clean_timings()`` times the launches differently while a package compiles: before each
timed launch the GPU reads (not writes) a buffer of 256 MB, about 60 µs on an H200, long
enough for the launch to be queued behind it and large enough to leave the L2 holding
clean lines of something else. The kernel's time is the least of ``REPS`` such spans.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

FLUSH_BYTES = 256 * 2**20
REPS = 32


@contextlib.contextmanager
def clean_timings(device: str) -> Iterator[None]:
    """While compiling for ``device`` ("cuda"): inductor's GPU benchmark times as above, and
    no launch parameters are taken from inductor's local cache of earlier tunings (which
    were timed the other way)."""
    if device != "cuda":
        yield
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime import benchmarking

    bench = getattr(benchmarking, "benchmarker", None)
    if bench is None:  # a torch laid out otherwise: tune as it does
        yield
        return
    had = "benchmark_gpu" in vars(bench)
    saved = vars(bench).get("benchmark_gpu")
    timed = functools.partial(_benchmark_gpu, buffers={})  # one flush buffer per compile
    # inductor's own holds a lock so that no two timings share the GPU (torch 2.13)
    lock = getattr(benchmarking, "gpu_benchmark_lock", None)
    bench.benchmark_gpu = lock(timed) if lock else timed
    try:
        with inductor_config.patch({"autotune_local_cache": False, "fx_graph_cache": False}):
            yield
    finally:
        if had:
            bench.benchmark_gpu = saved
        else:
            del bench.benchmark_gpu


def _benchmark_gpu(
    _callable: Callable[[], Any], *, buffers: dict[str, Any], **kwargs: Any
) -> float | list[float]:
    import torch

    torch.cuda.synchronize()
    _callable()  # compiles and warms up (and raises for a launch that cannot run)
    flush = buffers.get("flush")
    if flush is None:
        flush = buffers["flush"] = torch.ones(FLUSH_BYTES // 4, device="cuda")
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(REPS)
    ]
    torch.cuda.synchronize()
    for start, end in events:
        flush.sum()
        start.record()
        _callable()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return times if kwargs.get("return_mode") == "all" else min(times)
