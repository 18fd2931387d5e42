"""What a bucket's prefill calls cost, measured at start-up, for ``serve --prefill-merge auto``.

Whether prompts of different prefill lengths should share a call depends on the device: on a
GPU a small call is a pass over the weights whatever its few positions (1.2–1.5 ms on the
H200 for 1–2 prompts of 64–256 tokens, bench/RESULTS.md, sixteenth round), so sharing pays
for its padding; on cpu a position costs its compute, so padding costs more than a call.
Rather than a threshold tuned per device, ``measure`` times the bucket's own calls once, and
the engine splits each iteration's prompts into the calls that cost least by that table
(``placement.cheapest_prefills``).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("inf2_pipeline.serve")

# every prompt count up to here is timed, then doublings: cuda graphs a call of each count up
# to runtime.decode_session.PREFILL_GRAPH_PROMPTS (not imported: it would bring torch into the
# server's process; tests/test_prefill_costs.py keeps the two equal)
GRAPHED_PROMPTS = 8


@dataclass(frozen=True)
class PrefillCosts:
    """Median seconds of one prefill call, by (prompts, prefill length)."""

    seconds: dict[tuple[int, int], float]
    # (prompts, seconds) rising, by length: the engine asks many times an iteration
    _by_length: dict[int, list[tuple[int, float]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        by_length: dict[int, list[tuple[int, float]]] = {}
        for (p, t), s in sorted(self.seconds.items()):
            by_length.setdefault(t, []).append((p, s))
        object.__setattr__(self, "_by_length", by_length)

    def __call__(self, prompts: int, length: int) -> float:
        """A call's cost, interpolated linearly between the prompt counts measured at its
        length (every call the engine makes is within them)."""
        at = self._by_length.get(length)
        if not at:
            raise KeyError(f"no prefill call of length {length} was measured")
        for (p0, s0), (p1, s1) in itertools.pairwise(at):
            if p0 <= prompts <= p1:
                return s0 + (s1 - s0) * (prompts - p0) / (p1 - p0)
        p, s = at[0] if prompts < at[0][0] else at[-1]
        return s * prompts / p  # outside what was measured: proportional

    def describe(self) -> str:
        return "; ".join(
            f"{t}: " + " ".join(f"{p}×{s * 1e3:.2f}ms" for p, s in at)
            for t, at in sorted(self._by_length.items())
        )


def prompt_counts(limit: int) -> list[int]:
    """The prompt counts timed: each up to ``GRAPHED_PROMPTS``, then doublings, and the
    largest call itself."""
    counts = list(range(1, min(limit, GRAPHED_PROMPTS) + 1))
    n = GRAPHED_PROMPTS * 2
    while n < limit:
        counts.append(n)
        n *= 2
    if limit > counts[-1]:
        counts.append(limit)
    return counts


SLOW_S = 0.05  # a call this slow is compute: timed once, and no larger count at its length


def measure(
    slots: Any,
    reps: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    limit: int | None = None,
) -> PrefillCosts | None:
    """Time the bucket's prefill calls of up to ``limit`` prompts (default: as many as a
    call takes), the median of ``reps`` after one untimed call, in its first rows, freed
    after; None where the slots take one prompt a call (neuron: its context encoding runs at
    batch 1), so there is nothing to choose. Start-up stays short on a slow device: a call
    slower than ``SLOW_S`` is timed once, and larger counts at its length are not timed
    (their cost is taken as proportional: such calls are compute)."""
    size = min(int(getattr(slots, "prefill_batch", 1)), int(slots.batch), limit or 1 << 30)
    lengths = getattr(slots, "prefill_lengths", None)
    if size <= 1 or not lengths or not hasattr(slots, "prefill_many"):
        return None
    seconds: dict[tuple[int, int], float] = {}
    for length in lengths:
        for p in prompt_counts(size):
            rows, prompts = list(range(p)), [[0] * length for _ in range(p)]
            took: list[float] = []
            for rep in range(reps + 1):
                t = clock()
                slots.prefill_many(rows, prompts)  # returns the tokens: the call has ended
                took.append(clock() - t)
                for r in rows:
                    slots.free(r)
                if rep == 1 and took[-1] > SLOW_S:
                    break
            seconds[p, length] = statistics.median(took[1:] or took)
            if seconds[p, length] > SLOW_S:
                break
    return PrefillCosts(seconds)


def measure_all(
    model: Any, buckets: list[Any], limit: int | None = None
) -> dict[Any, PrefillCosts]:
    """``measure`` for each resident bucket that has a choice, logged."""
    out = {}
    for bucket in buckets:
        costs = measure(model.slots(bucket), limit=limit)
        if costs is not None:
            log.info("prefill calls of %s: %s", bucket.name, costs.describe())
            out[bucket] = costs
    return out
