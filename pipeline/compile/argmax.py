"""The greedy token inside the compiled graphs: every graph returns its logits' argmax beside
them, so a greedy step needs no kernel of its own (``pipeline.compile.decoder``)."""

from __future__ import annotations

from torch import Tensor


def greedy(logits: Tensor) -> tuple[Tensor, Tensor]:
    # The argmax inside the graph: compiled, it is one tuned kernel instead of an eager one
    # per step (on an H200, 0.07 ms of a 1.3 ms Llama-3.2-1B step).
    return logits, first_argmax(logits)


def first_argmax(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` (the first index of the maximum) in two stages: the argmax of
    each of ~128 slices of the vocabulary, then of their maxima.

    Inductor does not split an argmax, so one row's argmax was one program reading the whole
    vocabulary serially: 20 µs of a 1.0 ms batch-1 step on an H200 (128,256 tokens,
    bench/profile_cuda_decode.py). Slices make the first stage one program per slice."""
    v = logits.shape[-1]
    n = argmax_slices(v)
    if n == 1:
        return logits.argmax(-1)
    sliced = logits.view(*logits.shape[:-1], n, v // n)
    # the first slice holding the maximum, then the first index of it in that slice
    best = sliced.amax(-1).argmax(-1, keepdim=True)
    return (best * (v // n) + sliced.argmax(-1).gather(-1, best)).squeeze(-1)


def argmax_slices(vocab: int) -> int:
    """The divisor of ``vocab`` nearest 128 (between 16 and 1,024), or 1 for a vocabulary
    too small to gain (< 8,192) or without one."""
    if vocab < 8192:
        return 1
    divisors = [n for n in range(16, 1025) if vocab % n == 0]
    return min(divisors, key=lambda n: abs(n - 128), default=1)
