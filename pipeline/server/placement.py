"""Placement: which waiting requests go into which free slots at the start of an iteration.

A pure function of the waiting requests (oldest first) and the resident buckets' slots, so
the policy is unit-tested without a model. The engine (``pipeline.server.engine``) applies
what it returns.

The rules, in order:
- First come, first served: requests are placed in arrival order, and at most
  ``max_prefills`` per iteration (prefills stall every running row for their duration).
  A request that cannot be placed now keeps its place; nothing later takes a slot it could
  use, so nothing starves.
- A request needs ``need`` positions (prompt + answer, as the runner counts them). It goes to
  the resident bucket with the shortest sequence length that holds it and has a free slot:
  the least padding per step. With ``spill`` (the default), when every slot of that length is
  busy it takes a free slot of a longer bucket rather than wait: on cpu/cuda a longer bucket
  costs a short row almost nothing (decode attends only the filled positions; prefill runs
  at the prompt's own length). Without ``spill`` it waits for its own length.
- Among buckets of that length, one already running wins (its step is paid for anyway);
  else the smallest idle one whose batch holds every waiting request of that length, else
  the largest idle one: few buckets step per iteration, each as full as the traffic allows.
- When the running buckets of a length are full and a wider idle one opens (traffic grew
  out of them), it is the widest idle one, not the next size up: each bucket opened on the
  way up keeps its rows to their ends, one more step in every iteration until they drain.
  In the simulated-device bench (long replay, 32 clients) growing b1 → b8 → b32 stepped b8
  for ~200 iterations beside b32.
- An idle bucket of smaller batch than one of its length that is running is not opened
  (unless ``overflow``): each bucket stepping is one more pass over the weights in every
  iteration, so its few extra rows would slow every running row. Measured on the H200
  (bench/RESULTS.md, twelfth round): at 64 clients the b32 bucket full, b8 and b1 opened
  beside it made each iteration three steps and served 4,785 tokens/s against 6,680 at 32
  clients. A larger idle bucket may open (traffic grows out of a small one); then a smaller
  running one takes no new rows and drains: in the simulated-device bench
  (bench/bench_engine_host.py, long replay, 64 clients) a b8 kept refilled beside a full b32
  served 10,710 tokens/s, drained 12,344.
- With ``widest_from_idle``, a length with nothing running and several requests waiting
  opens its widest idle bucket at once (a lone request still takes the smallest): a burst
  that outgrows the bucket it opened would leave that one stepping beside the wider one
  until its rows end (b8 beside b32 for ~200 iterations of the long replay's opening, in
  the thirteenth round), at the cost of a wider step while the burst stays small.
- With a prefill stall budget (``serve --prefill-stall``), an iteration's placements stop
  at the first whose prefill would take the iteration's prefill work past it, by the
  start-up timings (``within_stall``), each bucket's prompts costed as the engine would
  launch them (folded into its step, a mixed call beyond the step; else their prefill
  calls): a burst of short prompts goes in at once (on a GPU a call of many costs little
  more than a call of one), a burst of long ones a few at a time, so neither the running
  rows nor the next arrivals wait out a long stall. The first placement always goes in.
- With ``admit_order`` ``shortest`` (``serve --admit-order shortest``), the waiting requests
  are offered to placement shortest prompt first, not as they came (``admission_order``),
  so a burst's first iteration admits more first tokens within a prefill stall: at 6 ms,
  19 of a closed loop's 32 opening prompts against 11 (bench/RESULTS.md, twenty-sixth
  round; on the H100 it moved neither p99, so it is off by default). A request left waiting
  while a later one was admitted is *passed over* (``passed_over``); from then on it goes
  before every request not passed over, in arrival order, so no request is overtaken in
  more than one iteration.
- ``static`` batching (the old batch-at-a-time server, kept to compare): a bucket admits
  only when none of its rows is running, and then as many requests as it holds, whatever
  ``max_prefills`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pipeline.contracts.bucket import Bucket

BATCHING = ("iteration", "static")
ADMIT_ORDERS = ("fcfs", "shortest")
R = TypeVar("R")  # a request, to the calls that group them
K = TypeVar("K")  # what a placement's stall is counted by: its bucket


@dataclass
class BucketSlots:
    """What placement needs to know of one resident bucket."""

    bucket: Bucket
    free: list[int]  # free slot ids, lowest first
    running: int  # rows in use
    admitted: int = 0  # placed in this iteration (placement's own count)


@dataclass(frozen=True)
class Placement:
    index: int  # into the waiting list
    bucket: Bucket
    slot: int


def place(
    needs: Sequence[int],
    buckets: Sequence[BucketSlots],
    *,
    max_prefills: int,
    spill: bool = True,
    batching: str = "iteration",
    overflow: bool = False,
    widest_from_idle: bool = False,
) -> list[Placement]:
    """Placements for the waiting requests whose needs are ``needs`` (oldest first)."""
    if batching not in BATCHING:
        raise ValueError(f"batching {batching!r}: one of {', '.join(BATCHING)}")
    out: list[Placement] = []
    state = {b.bucket: BucketSlots(b.bucket, list(b.free), b.running) for b in buckets}
    lengths = sorted({b.bucket.seq for b in buckets})
    for i, need in enumerate(needs):
        # static batching fills an empty bucket at once, as the batch-at-a-time server did
        if len(out) >= max_prefills and batching == "iteration":
            break
        fitting = [s for s in lengths if s >= need]
        if not fitting:
            continue  # admission refuses these; never placed
        for seq in fitting if spill else fitting[:1]:
            same = [b for b in state.values() if b.bucket.seq == seq]
            open_ = [b for b in same if b.free and _admits(b, batching)]
            widest = max((b.bucket.batch for b in same if _busy(b)), default=0)
            if not overflow and batching == "iteration":  # none narrower than one running
                open_ = [b for b in open_ if b.bucket.batch >= widest]
            if not open_:
                continue
            demand = sum(1 for n in needs[i:] if n <= seq)
            if widest and not overflow and not any(_busy(b) for b in open_):
                chosen = max(open_, key=lambda b: b.bucket.batch)  # outgrown: the widest
            elif widest_from_idle and demand > 1 and not any(_busy(b) for b in same):
                chosen = max(open_, key=lambda b: b.bucket.batch)  # a burst from idle
            else:
                chosen = _choose(open_, demand)
            slot = chosen.free.pop(0)
            chosen.admitted += 1
            out.append(Placement(i, chosen.bucket, slot))
            break
    return out


def admission_order(lengths: Sequence[int], passed: Sequence[bool], order: str) -> list[int]:
    """The order in which an iteration offers the waiting requests to ``place`` (indices into
    them; they come oldest first, ``lengths`` their prompts' lengths): ``fcfs`` as they came;
    ``shortest``: those ``passed`` over before, as they came, then the others by prompt
    length, shortest first (ties as they came)."""
    if order not in ADMIT_ORDERS:
        raise ValueError(f"admit order {order!r}: one of {', '.join(ADMIT_ORDERS)}")
    if order == "fcfs":
        return list(range(len(lengths)))
    first = [i for i, p in enumerate(passed) if p]
    return first + sorted((i for i, p in enumerate(passed) if not p), key=lambda i: lengths[i])


def passed_over(admitted: Collection[int], waiting: int) -> list[int]:
    """Of ``waiting`` requests (oldest first), those left waiting while a later one was
    admitted (``admitted``: indices into them)."""
    last = max(admitted, default=-1)
    return [i for i in range(last) if i not in admitted]


def within_stall(keys: Sequence[K], stall: Callable[[K, list[int]], float], budget: float) -> int:
    """How many of an iteration's placements (in the order ``place`` made them, each named by
    its ``key``: its bucket) fit a prefill stall of ``budget`` seconds: a prefix, first come
    first served. A prefix's stall is what each key's placements in it add to the iteration
    (``stall(key, indices)``, all of that key's in the prefix, costed as the engine would
    launch them: their prefill calls, or a mixed call beyond the step), summed over keys.
    The first placement always fits, so a prompt dearer than the budget still goes in,
    alone. The stall grows with the prefix (a cheaper shared call aside, which may let a
    longer prefix fit), so the prefix is found by doubling, then bisection: a few costings,
    where one per placement (each costing a bucket's split, itself quadratic) took ~3 ms of
    host time under the engine's lock for a burst of 32 prompts on the 2-core VM."""

    def total(n: int) -> float:
        mine: dict[K, list[int]] = {}
        for i, key in enumerate(keys[:n]):
            mine.setdefault(key, []).append(i)
        return sum(stall(key, chosen) for key, chosen in mine.items())

    fits, over = min(1, len(keys)), len(keys)
    n = 2  # doubling first: a costing's price grows with its prefix, and most fit few
    while n < over:
        if total(n) > budget:
            over = n
            break
        fits, n = n, 2 * n
    else:
        if over <= fits or total(over) <= budget:
            return over
    while over - fits > 1:  # total(fits) is within the budget (or fits is 1), total(over) not
        mid = (fits + over) // 2
        if total(mid) <= budget:
            fits = mid
        else:
            over = mid
    return fits


def _admits(b: BucketSlots, batching: str) -> bool:
    # static: only a bucket that had no rows running when this iteration began
    return batching == "iteration" or b.running == 0


def _busy(b: BucketSlots) -> bool:
    return bool(b.running or b.admitted)


def _choose(open_: list[BucketSlots], demand: int) -> BucketSlots:
    running = [b for b in open_ if _busy(b)]
    if running:  # the fullest running bucket first: keep the others idle
        return max(running, key=lambda b: (b.running + b.admitted, -b.bucket.batch))
    idle = sorted(open_, key=lambda b: b.bucket.batch)
    return next((b for b in idle if b.bucket.batch >= demand), idle[-1])


def prefill_calls(
    items: list[tuple[int, R, int]],
    size: int,
    merge: int,
    cost: Callable[[int, int], float] | None = None,
) -> list[tuple[int, list[tuple[int, R, int]]]]:
    """One bucket's prefill calls: by its measured ``cost`` where it has one
    (``cheapest_prefills``), else within the padding ``merge`` allows (``merged_prefills``)."""
    if cost is not None:
        return cheapest_prefills(items, size, cost)
    return merged_prefills(items, size, merge)


def merged_prefills(
    items: list[tuple[int, R, int]], size: int, merge: int
) -> list[tuple[int, list[tuple[int, R, int]]]]:
    """The prefill calls for one bucket's admitted requests, each given as (its prefill
    length, the request, its slot) in admission order; each call as (its prefill length,
    its requests), at most ``size`` of them. With ``merge`` 0 only prompts of one prefill
    length share a call. Else a prompt of length t also joins a call at a longer length T
    where T - t ≤ ``merge`` (it pays T - t padded positions, and the call's fixed cost is
    paid once): each call, longest first, takes the longest prompts left that it holds so,
    admission order among equals."""
    calls: list[tuple[int, list[tuple[int, R, int]]]] = []
    if merge <= 0:
        groups: dict[int, list[tuple[int, R, int]]] = {}
        for it in items:
            groups.setdefault(it[0], []).append(it)
        for length, group in groups.items():
            calls += [(length, group[a : a + size]) for a in range(0, len(group), size)]
        return calls
    left = sorted(items, key=lambda it: -it[0])  # stable: admission order among equals
    while left:  # longest first, so the prompts a call holds are a prefix of what is left
        length = left[0][0]
        n = next((i for i, it in enumerate(left) if length - it[0] > merge), len(left))
        calls.append((length, left[: min(n, size)]))
        left = left[min(n, size) :]
    return calls


def cheapest_prefills(
    items: list[tuple[int, R, int]], size: int, cost: Callable[[int, int], float]
) -> list[tuple[int, list[tuple[int, R, int]]]]:
    """``merged_prefills`` by measured cost (``serve --prefill-merge auto``): the split of one
    bucket's admitted prompts into calls, each at most ``size`` prompts at its longest
    prompt's prefill length, whose summed ``cost(prompts, length)`` is least. Where a call's
    fixed cost dominates (a GPU: a pass over the weights, whatever the few positions) prompts
    share calls; where a position costs its compute (cpu) they stay at their own lengths.
    Calls take runs of the prompts sorted longest first (with cost rising in both arguments
    some cheapest split is such runs), found by dynamic programming over those runs."""
    left = sorted(items, key=lambda it: -it[0])  # stable: admission order among equals
    n = len(left)
    best = [0.0] * (n + 1)  # best[i]: the least cost of the calls for left[i:]
    cut = [n] * (n + 1)  # where the first call of that split ends
    for i in range(n - 1, -1, -1):
        best[i] = float("inf")
        for j in range(i + 1, min(n, i + size) + 1):
            c = cost(j - i, left[i][0]) + best[j]
            if c < best[i]:  # ties keep the smaller call: no padding for nothing
                best[i], cut[i] = c, j
    calls, i = [], 0
    while i < n:
        calls.append((left[i][0], left[i : cut[i]]))
        i = cut[i]
    return calls


FOLD = ("auto", "always", "off")


def fold_prompts(lengths: Sequence[int], longest: int, most: int, seq: int) -> list[int]:
    """Which of a bucket's admitted prompts (their lengths, in admission order) ride in the
    bucket's step as one mixed call, packed end to end into one stream: in admission order,
    each that still fits (``longest`` tokens in all, ``most`` prompts), none of the
    bucket's whole length ``seq`` (a stream's padding goes into a shorter prompt's row).
    The others are prefilled apart in the same iteration, so the order costs no one a turn."""
    chosen: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if len(chosen) >= most:
            break
        if n < seq and total + n <= longest:
            chosen.append(i)
            total += n
    return chosen
