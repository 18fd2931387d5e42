"""Fit sequence-length buckets to real traffic, exactly.

Each request runs in the smallest bucket that holds it, so a grid's *efficiency* is
Σ request lengths ÷ Σ bucket lengths used: the share of computed tokens that are real.
Given at most K buckets (multiples of M), ``fit`` finds the grid of highest efficiency.

Why it is exact: some optimal grid uses only the candidates ``ceil(length / M) · M`` (a
bucket between two candidates can move down to the lower one and hold the same requests),
and the largest candidate must be a bucket. Over the n sorted distinct candidates v with
cumulative request counts P, the cost of the bucket at v[t-1] holding groups s..t-1 is
``v[t-1] · (P[t] - P[s])``: per layer, ``f_k(t) = min_s f_{k-1}(s) - P[s]·v[t-1]`` plus
``P[t]·v[t-1]``, a lower envelope of lines with falling slopes -P[s] queried at rising
x = v[t-1]. The monotone convex-hull trick answers each layer in O(n), so K buckets cost
O(K·n) in exact integer arithmetic, after an O(N) pass over the N requests.
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pipeline.errors import InputError
from pipeline.plan.buckets import BucketGrid

# Each bucket is a compiled graph (minutes to hours of neuronx-cc); a target that needs more
# is a sign to lower it, and the layered search is O(buckets × candidates).
MAX_TARGET_BUCKETS = 256


@dataclass(frozen=True)
class BucketUse:
    """How one bucket is used: its requests, their real tokens, and the padding it adds."""

    seq: int
    requests: int
    tokens: int

    @property
    def computed(self) -> int:
        return self.requests * self.seq

    @property
    def padding_share(self) -> float:
        """Share of this bucket's computed tokens that are padding."""
        return 1 - self.tokens / self.computed if self.computed else 0.0


@dataclass(frozen=True)
class Scored:
    """A list of bucket lengths scored on a set of requests."""

    buckets: tuple[int, ...]
    tokens: int  # Σ request lengths
    computed: int  # Σ smallest bucket ≥ each request

    @property
    def efficiency(self) -> float:
        return self.tokens / self.computed if self.computed else 1.0

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "efficiency": self.efficiency}


@dataclass(frozen=True)
class FitResult:
    fitted: Scored
    rejected: int  # requests longer than max_len: counted, not served, not scored
    accepted: int
    multiple_of: int
    max_len: int | None
    uses: tuple[BucketUse, ...]
    baselines: dict[str, Scored] = field(default_factory=dict)

    @property
    def buckets(self) -> list[int]:
        return list(self.fitted.buckets)

    @property
    def efficiency(self) -> float:
        return self.fitted.efficiency

    def to_dict(self) -> dict:
        return {
            "buckets": self.buckets,
            "efficiency": self.efficiency,
            "rejected": self.rejected,
            "baselines": {name: s.to_dict() for name, s in self.baselines.items()},
        }


def fit(
    lengths: Sequence[int],
    *,
    max_buckets: int | None = None,
    target_efficiency: float | None = None,
    multiple_of: int = 1,
    max_len: int | None = None,
) -> FitResult:
    """The most efficient grid of at most ``max_buckets`` lengths, or the smallest grid that
    reaches ``target_efficiency`` (give exactly one). Requests longer than ``max_len`` are
    rejected and counted; the baselines (``pow2``, ``single``) score the same requests."""
    if (max_buckets is None) == (target_efficiency is None):
        raise InputError(
            "fit", "give exactly one of max_buckets and target_efficiency", "see --help"
        )
    _check_args(max_buckets, target_efficiency, multiple_of, max_len)
    accepted = [n for n in lengths if max_len is None or n <= max_len]
    rejected = len(lengths) - len(accepted)
    if not accepted:
        raise InputError(
            "--max-len",
            f"all {len(lengths)} requests are longer than {max_len}" if lengths else "no requests",
            "raise --max-len",
        )
    values, weights = candidates(accepted, multiple_of)
    if max_buckets is not None:
        chosen = optimal_buckets(values, weights, max_buckets)
    else:
        assert target_efficiency is not None
        chosen = fewest_buckets(values, weights, sum(accepted), target_efficiency)
    longest = max(accepted)
    return FitResult(
        fitted=score(accepted, chosen),
        rejected=rejected,
        accepted=len(accepted),
        multiple_of=multiple_of,
        max_len=max_len,
        uses=tuple(bucket_uses(accepted, chosen)),
        baselines={
            "pow2": score(accepted, pow2_buckets(longest)),
            "single": score(accepted, [max(longest, 1)]),
        },
    )


def _check_args(
    max_buckets: int | None, target: float | None, multiple_of: int, max_len: int | None
) -> None:
    if max_buckets is not None and max_buckets < 1:
        raise InputError("--max-buckets", f"{max_buckets} is not ≥ 1", "give at least 1 bucket")
    if target is not None and not 0 < target <= 1:
        raise InputError(
            "--target-efficiency", f"{target} is not in (0, 1]", "e.g. 0.9 for 90% real tokens"
        )
    if multiple_of < 1:
        raise InputError("--multiple-of", f"{multiple_of} is not ≥ 1", "e.g. 64")
    if max_len is not None:
        if max_len < 1:
            raise InputError("--max-len", f"{max_len} is not ≥ 1", "e.g. 8192")
        if max_len % multiple_of:
            # Otherwise the bucket for the longest allowed request would exceed max_len.
            lo, hi = max_len // multiple_of * multiple_of, _round_up(max_len, multiple_of)
            raise InputError(
                "--max-len",
                f"{max_len} is not a multiple of --multiple-of {multiple_of}",
                f"use {hi}" if lo == 0 else f"use {lo} or {hi}",
            )


def _round_up(n: int, m: int) -> int:
    # At least m: a bucket holds ≥ 1 token, even for an empty request.
    return max(-(-n // m) * m, m)


def candidates(lengths: Sequence[int], multiple_of: int = 1) -> tuple[list[int], list[int]]:
    """Sorted distinct bucket candidates and how many requests round up to each."""
    counts = Counter(_round_up(n, multiple_of) for n in lengths)
    values = sorted(counts)
    return values, [counts[v] for v in values]


def optimal_buckets(values: Sequence[int], weights: Sequence[int], k: int) -> list[int]:
    """The ≤ k candidates that minimise Σ weight × smallest chosen value ≥ its candidate."""
    n = len(values)
    if k >= n:
        return list(values)
    args: list[array] = []
    for _cost, arg in _layers(values, weights):
        args.append(arg)
        if len(args) == k:
            break
    return _backtrack(values, args)


def fewest_buckets(
    values: Sequence[int], weights: Sequence[int], tokens: int, target: float
) -> list[int]:
    """The fewest candidates whose efficiency (``tokens`` ÷ computed) reaches ``target``."""
    best = sum(v * w for v, w in zip(values, weights, strict=True))  # every candidate a bucket
    if tokens < target * best:
        raise InputError(
            "--target-efficiency",
            f"{target:.4g} is out of reach: {len(values)} buckets give {tokens / best:.4f}",
            "lower the target or --multiple-of",
        )
    args: list[array] = []
    for cost, arg in _layers(values, weights):
        args.append(arg)
        if tokens >= target * cost:
            return _backtrack(values, args)
        if len(args) == MAX_TARGET_BUCKETS:
            break
    raise InputError(
        "--target-efficiency",
        f"{target:.4g} needs more than {MAX_TARGET_BUCKETS} buckets "
        f"({MAX_TARGET_BUCKETS} give {tokens / cost:.4f})",
        "lower the target, or use --max-buckets",
    )


def _layers(values: Sequence[int], weights: Sequence[int]) -> Iterator[tuple[int, array]]:
    """For k = 1, 2, … n: the least cost with k buckets covering all candidates, and for
    each prefix t the split point of its last bucket (for backtracking)."""
    n = len(values)
    P = [0] * (n + 1)
    for i, w in enumerate(weights):
        P[i + 1] = P[i] + w
    # f[t]: least cost covering the first t candidates with k buckets, the last at values[t-1].
    f = [0] + [values[t - 1] * P[t] for t in range(1, n + 1)]
    yield f[n], array("i", [0] * (n + 1))
    inf = float("inf")
    for k in range(2, n + 1):
        g = [inf] * (n + 1)
        arg = array("i", [0] * (n + 1))
        # The hull: line s is y = f[s] - P[s]·x; slopes fall as s grows, queries x rise.
        ms: list[int] = []
        bs: list[int] = []
        ss: list[int] = []
        head = 0
        for t in range(k, n + 1):
            s = t - 1  # line s becomes usable once t > s
            m, b = -P[s], f[s]
            while len(ms) - head >= 2:
                m1, b1, m2, b2 = ms[-2], bs[-2], ms[-1], bs[-1]
                # Drop the last line if the new one undercuts it wherever it was lowest.
                if (b - b1) * (m1 - m2) <= (b2 - b1) * (m1 - m):
                    ms.pop()
                    bs.pop()
                    ss.pop()
                else:
                    break
            ms.append(m)
            bs.append(b)
            ss.append(s)
            x = values[t - 1]
            while (
                len(ms) - head >= 2 and bs[head + 1] + ms[head + 1] * x <= bs[head] + ms[head] * x
            ):
                head += 1
            g[t] = bs[head] + ms[head] * x + P[t] * x
            arg[t] = ss[head]
        f = g
        yield f[n], arg


def _backtrack(values: Sequence[int], args: list[array]) -> list[int]:
    chosen = []
    t = len(values)
    for arg in reversed(args):
        chosen.append(values[t - 1])
        t = arg[t]
    return sorted(chosen)


def score(lengths: Sequence[int], buckets: Sequence[int]) -> Scored:
    """Efficiency of ``buckets`` on ``lengths`` (each length ≤ the largest bucket)."""
    grid = sorted(buckets)
    computed = sum(grid[bisect.bisect_left(grid, n)] for n in lengths)
    return Scored(tuple(grid), sum(lengths), computed)


def bucket_uses(lengths: Sequence[int], buckets: Sequence[int]) -> list[BucketUse]:
    grid = sorted(buckets)
    requests = [0] * len(grid)
    tokens = [0] * len(grid)
    for n in lengths:
        i = bisect.bisect_left(grid, n)
        requests[i] += 1
        tokens[i] += n
    return [BucketUse(s, r, t) for s, r, t in zip(grid, requests, tokens, strict=True)]


def pow2_buckets(longest: int) -> list[int]:
    """NxD Inference's default: powers of two from 128 up to the first one ≥ ``longest``."""
    grid = [128]
    while grid[-1] < longest:
        grid.append(grid[-1] * 2)
    return grid


def fit_prefill_lengths(
    prompts: Sequence[int],
    needs: Sequence[int],
    seq_lengths: Sequence[int],
    k: int,
    multiple_of: int = 1,
) -> tuple[list[int], float]:
    """Up to ``k`` prefill lengths for a grid, and the prompt efficiency they reach.

    A request runs in the shortest bucket S ≥ its need (prompt + answer) and prefills its
    prompt n at the shortest of S's prefill lengths ≥ n: those below S, or S itself. Lengths
    are chosen greedily, each the one that saves the most prefill positions given those
    before it (candidates: prompt lengths rounded up to ``multiple_of``), stopping early when
    none saves any. Requests longer than every bucket are left out."""
    seqs = sorted(seq_lengths)
    groups: Counter[tuple[int, int]] = Counter()  # (bucket S, rounded prompt) -> requests
    real = 0
    for n, need in zip(prompts, needs, strict=True):
        at = bisect.bisect_left(seqs, need)
        if at == len(seqs) or n < 1:
            continue
        groups[(seqs[at], min(_round_up(n, multiple_of), seqs[at]))] += 1
        real += n
    if not groups:
        raise InputError("prefill lengths", "no request fits the grid", None)
    cost = {g: g[0] for g in groups}  # positions each group's prefill computes now
    candidates = sorted({n for _, n in groups if n < seqs[-1]})
    chosen: list[int] = []
    for _ in range(k):
        gains = {
            c: sum(groups[g] * (cost[g] - c) for g in groups if g[1] <= c < cost[g])
            for c in candidates
            if c not in chosen
        }
        best = max(gains, key=lambda c: (gains[c], -c), default=None)
        if best is None or gains[best] <= 0:
            break
        chosen.append(best)
        for g in groups:
            if g[1] <= best < cost[g]:
                cost[g] = best
    computed = sum(groups[g] * cost[g] for g in groups)
    return sorted(chosen), real / computed


def to_grid(
    result: FitResult, batch_sizes: Sequence[int] = (1,), prefill: Sequence[int] = ()
) -> BucketGrid:
    """The fitted lengths × ``batch_sizes`` (and ``prefill`` lengths) as a grid file's model."""
    sizes = list(batch_sizes)
    bad = [b for b in sizes if b < 1]
    dups = sorted({b for b in sizes if sizes.count(b) > 1})
    if not sizes or bad or dups:
        why = "empty" if not sizes else f"{bad[0]} is not ≥ 1" if bad else f"{dups} repeated"
        raise InputError("--batch-sizes", why, "e.g. 1,4,8")
    longest = max(result.buckets)
    return BucketGrid(
        batch_sizes=sizes,
        sequence_lengths=result.buckets,
        prefill_lengths=sorted({n for n in prefill if n < longest}),
    )


def grid_comment(result: FitResult, source: str) -> str:
    """The provenance a fitted grid file carries: what was fitted, and how well it does."""
    pow2, single = result.baselines["pow2"], result.baselines["single"]
    lines = [
        f"Fitted by `inf2-pipeline buckets fit` to {source}: {result.accepted} requests, "
        f"{len(result.buckets)} buckets, multiples of {result.multiple_of}.",
        f"Efficiency (real ÷ computed tokens) {result.efficiency:.1%}; on the same requests "
        f"pow2 ({len(pow2.buckets)} buckets) {pow2.efficiency:.1%}, "
        f"single ({single.buckets[0]}) {single.efficiency:.1%}.",
    ]
    if result.max_len is not None:
        lines.append(f"Rejected: {result.rejected} longer than --max-len {result.max_len}.")
    return "\n".join(lines)
