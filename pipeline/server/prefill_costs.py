"""What a bucket's prefill calls cost, measured at start-up, for ``serve --prefill-merge auto``,
and what folding them into a step saves, for ``serve --fold-prompts auto``.

Whether prompts of different prefill lengths should share a call depends on the device: on a
GPU a small call is a pass over the weights whatever its few positions (1.2–1.5 ms on the
H200 for 1–2 prompts of 64–256 tokens, bench/RESULTS.md, sixteenth round), so sharing pays
for its padding; on cpu a position costs its compute, so padding costs more than a call.
Rather than a threshold tuned per device, ``measure`` times the bucket's own calls once, and
the engine splits each iteration's prompts into the calls that cost least by that table
(``placement.cheapest_prefills``). Where the bucket has a mixed graph (a step and prompts
packed into one stream, in one call), a step and a mixed call at each stream length are
timed too, and the engine folds prompts into their bucket's step where the mixed call costs
less than their prefill calls and the step apart (``placement.fold_prompts``).
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
    """Median seconds of one prefill call, by (prompts, prefill length); of one step (one row
    stepping) and of one mixed call (that step and prompts), by its stream's length, where
    measured."""

    seconds: dict[tuple[int, int], float]
    step: float = 0.0
    mixed: dict[int, float] = field(default_factory=dict)
    # (prompts, seconds) rising, by length: the engine asks many times an iteration
    _by_length: dict[int, list[tuple[int, float]]] = field(init=False, repr=False)
    # each cost asked, kept: a split of 32 prompts, costed again for each admission under
    # --prefill-stall, asks thousands of times
    _asked: dict[tuple[int, int], float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_length", _by_length(self.seconds))
        object.__setattr__(self, "_asked", {})

    def __call__(self, prompts: int, length: int) -> float:
        """A call's cost, interpolated linearly between the prompt counts measured at its
        length (every call the engine makes is within them)."""
        key = (prompts, length)
        cost = self._asked.get(key)
        if cost is None:
            cost = self._asked[key] = _interpolated(self._by_length, prompts, length, "prefill")
        return cost

    def fold_saving(self, apart: float, stream: int) -> float:
        """What folding prompts into their bucket's step saves, as a mixed call whose stream
        is ``stream`` long, where their prefill calls cost ``apart``: those calls and the step,
        less the mixed call (negative: it costs; -inf where no mixed call was measured)."""
        mixed = self.mixed_call(stream)
        return float("-inf") if mixed is None else apart + self.step - mixed

    def mixed_call(self, stream: int) -> float | None:
        """A mixed call's cost (a step and a stream of ``stream`` positions), interpolated
        linearly between the lengths measured (the shortest's below it, proportionally past
        the longest: such a call is compute); None where none was."""
        if not self.mixed:
            return None
        return _along(sorted(self.mixed.items()), stream, flat_below=True)

    def describe(self) -> str:
        text = _describe(self._by_length)
        if not self.mixed:
            return text
        mixed = " ".join(f"{n}:{s * 1e3:.2f}ms" for n, s in sorted(self.mixed.items()))
        return f"{text}; a step {self.step * 1e3:.2f}ms; mixed, by stream length, {mixed}"


def _describe(by_length: dict[int, list[tuple[int, float]]]) -> str:
    return "; ".join(
        f"{t}: " + " ".join(f"{p}×{s * 1e3:.2f}ms" for p, s in at)
        for t, at in sorted(by_length.items())
    )


def _by_length(seconds: dict[tuple[int, int], float]) -> dict[int, list[tuple[int, float]]]:
    by_length: dict[int, list[tuple[int, float]]] = {}
    for (p, t), s in sorted(seconds.items()):
        by_length.setdefault(t, []).append((p, s))
    return by_length


def _interpolated(
    by_length: dict[int, list[tuple[int, float]]], prompts: int, length: int, kind: str
) -> float:
    at = by_length.get(length)
    if not at:
        raise KeyError(f"no {kind} call of length {length} was measured")
    return _along(at, prompts)


def _along(at: list[tuple[int, float]], x: int, flat_below: bool = False) -> float:
    """Seconds at ``x`` by the measured (x, seconds) points ``at`` (rising): linear between
    two, proportional outside them (below the first: its own, where ``flat_below``)."""
    if flat_below and x <= at[0][0]:
        return at[0][1]
    for (x0, s0), (x1, s1) in itertools.pairwise(at):
        if x0 <= x <= x1:
            return s0 + (s1 - s0) * (x - x0) / (x1 - x0)
    n, s = at[0] if x < at[0][0] else at[-1]
    return s * x / n


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
    after, and a step and the mixed calls where the slots have them; None where the slots
    take one prompt a call and have no mixed calls (neuron: its context encoding runs at
    batch 1), so there is nothing to choose. Start-up stays short on a slow device: a call
    slower than ``SLOW_S`` is timed once, and larger counts at its length are not timed
    (their cost is taken as proportional: such calls are compute)."""
    size = min(int(getattr(slots, "prefill_batch", 1)), int(slots.batch), limit or 1 << 30)
    lengths = getattr(slots, "prefill_lengths", None)
    mixes = bool(getattr(slots, "mixed_lengths", ())) and hasattr(slots, "launch_mixed")
    if (size <= 1 and not mixes) or not lengths or not hasattr(slots, "prefill_many"):
        return None
    seconds: dict[tuple[int, int], float] = {}
    for length in lengths:
        for p in prompt_counts(size):
            rows, prompts = list(range(p)), [[0] * length for _ in range(p)]

            def call(rows: list[int] = rows, prompts: list[list[int]] = prompts) -> None:
                slots.prefill_many(rows, prompts)  # returns the tokens: the call has ended
                for r in rows:
                    slots.free(r)

            seconds[p, length] = _timed(call, reps, clock)
            if seconds[p, length] > SLOW_S:
                break
    step, mixed = _measure_mixed(
        slots, min(size, int(getattr(slots, "mixed_batch", 0))), reps, clock
    )
    return PrefillCosts(seconds, step, mixed)


def mixed_prompts(stream: int, seq: int, most: int) -> list[int] | None:
    """Prompt lengths that fill a mixed call's stream of ``stream`` positions exactly, each
    shorter than the bucket (``seq``), at most ``most`` of them (None: they cannot)."""
    k = -(-stream // max(seq - 1, 1))
    if k > most or stream < 1:
        return None
    return [stream // k + (i < stream % k) for i in range(k)]


def _measure_mixed(
    slots: Any, size: int, reps: int, clock: Callable[[], float]
) -> tuple[float, dict[int, float]]:
    """A step of row 0 alone, and that step with prompts in rows 1.. filling a stream of
    each mixed length (nothing where the slots have no mixed calls)."""
    lengths = getattr(slots, "mixed_lengths", ())
    if size < 1 or not lengths or not hasattr(slots, "launch_mixed") or slots.seq < 4:
        return 0.0, {}
    ready = _stepping_row(slots)
    step_s = _timed(lambda: slots.step([0]), reps, clock, ready)
    mixed: dict[int, float] = {}
    for length in lengths:
        sizes = mixed_prompts(length, slots.seq, size)
        if sizes is None:
            continue
        rows, prompts = list(range(1, len(sizes) + 1)), [[0] * n for n in sizes]

        def call(rows: list[int] = rows, prompts: list[list[int]] = prompts) -> None:
            slots.launch_mixed([0], rows, prompts).tokens()
            for r in rows:
                slots.free(r)

        mixed[length] = _timed(call, reps, clock, ready)
        if mixed[length] > SLOW_S:
            break
    slots.free(0)
    return step_s, mixed


def _stepping_row(slots: Any) -> Callable[[], None]:
    """A setup that keeps row 0 holding a short prompt with room for its next step."""
    at = [slots.seq]  # row 0's next position: filled again before it runs out

    def ready() -> None:
        if at[0] >= slots.seq - 1:
            slots.free(0)
            slots.prefill(0, [0, 0])
            at[0] = 2
        at[0] += 1

    return ready


def measure_step(
    slots: Any, reps: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float | None:
    """A step's seconds (row 0 stepping), the median of ``reps``; None where the bucket is
    too short to step (what ``serve --launch-lead`` predicts a step from, where no
    ``measure`` timed one)."""
    if slots.seq < 4:
        return None
    ready = _stepping_row(slots)
    try:
        return _timed(lambda: slots.step([0]), reps, clock, ready)
    finally:
        slots.free(0)


def _timed(
    call: Callable[[], None],
    reps: int,
    clock: Callable[[], float],
    setup: Callable[[], None] | None = None,
) -> float:
    """The median of ``reps`` timings of ``call`` (each after ``setup``, untimed) after an
    untimed one; a call slower than ``SLOW_S`` is timed once."""
    took: list[float] = []
    for rep in range(reps + 1):
        if setup is not None:
            setup()
        t = clock()
        call()
        took.append(clock() - t)
        if rep == 1 and took[-1] > SLOW_S:
            break
    return statistics.median(took[1:] or took)


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
