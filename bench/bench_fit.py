"""Bucket fitting on the real Azure conversation trace: time, and efficiency as ratios to
NxD Inference's powers of two (pow2) and a single static shape (single).

    python bench/bench_fit.py [TRACE.csv]
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

from pipeline.plan.fit import fit
from pipeline.plan.traces import read_lengths

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared/traces/AzureLLMInferenceTrace_conv.csv"
MULTIPLE_OF = 64


def best_of(runs: int, fn):
    """The fastest of ``runs`` calls (the least disturbed by other work), and the result."""
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else TRACE
    if not trace.exists():
        sys.exit(f"error: {trace}: no such file (pass a trace path)")
    for columns in (("ContextTokens", None), ("ContextTokens", "GeneratedTokens")):
        read_s, lengths = best_of(3, partial(read_lengths, trace, *columns))
        name = " + ".join(c for c in columns if c)
        print(f"{trace.name} · {name}: {len(lengths):,} requests (read in {read_s * 1e3:.0f} ms)")
        print(
            f"  {'M':>3} {'K':>3} {'fit ms':>7} {'fitted':>7} {'pow2':>7} {'single':>7}"
            f" {'÷pow2':>6} {'÷single':>8}"
        )
        for m in (1, MULTIPLE_OF):
            for k in (4, 8, 16):
                secs, r = best_of(3, partial(fit, lengths, max_buckets=k, multiple_of=m))
                pow2, single = r.baselines["pow2"].efficiency, r.baselines["single"].efficiency
                print(
                    f"  {m:>3} {k:>3} {secs * 1e3:>7.1f} {r.efficiency:>7.1%} {pow2:>7.1%}"
                    f" {single:>7.1%} {r.efficiency / pow2:>5.2f}× {r.efficiency / single:>7.2f}×"
                )
        # The other way round: how few buckets waste no more than pow2 does.
        r = fit(lengths, max_buckets=1, multiple_of=MULTIPLE_OF)
        pow2 = r.baselines["pow2"]
        target = partial(fit, lengths, target_efficiency=pow2.efficiency, multiple_of=MULTIPLE_OF)
        secs, same = best_of(3, target)
        print(
            f"  pow2's {pow2.efficiency:.1%} with {len(same.buckets)} fitted buckets instead of "
            f"{len(pow2.buckets)} ({len(pow2.buckets) / len(same.buckets):.2f}× fewer; "
            f"--target-efficiency in {secs * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main()
